"""experiments/offload_accum/summary.py on made-up records: the ratio to offload=none, offload=full's host step from
metrics.jsonl, the crossover (measured, and by the fixed-cost model) and the losses' distance from none's."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

SUMMARY = Path(__file__).resolve().parents[1] / "experiments" / "offload_accum" / "summary.py"
TARGETS = {"none": "moe_lab.optim.offload.NoOffload", "full": "moe_lab.optim.offload.FullOffload"}


def write_point(
    root: Path, index: int, accum: int, mode: str, s_per_step: float, host_rows: list[dict] = (), losses=None
) -> None:
    point = root / str(index)
    point.mkdir()
    config = {"offload": {"_target_": TARGETS[mode]}, "trainer": {"grad_accum": accum, "timing_skip": 1}}
    metrics = {"s_per_step": s_per_step, "tokens_per_s_per_gpu": 1000.0, "mfu": 0.5}
    if losses is not None:
        metrics["losses"] = losses
    (point / "result.json").write_text(json.dumps({"config": config, "status": "ok", "metrics": metrics}))
    (point / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": i, **row}) + "\n" for i, row in enumerate(host_rows))
    )


def test_summary_shows_ratios_host_step_and_crossover(tmp_path, capsys, monkeypatch):
    # none: 0.2 s per micro-batch; full: 0.4 s more per step, whatever the accumulation
    write_point(tmp_path, 0, 1, "none", 0.2)
    write_point(tmp_path, 1, 1, "full", 0.6)
    write_point(tmp_path, 2, 8, "none", 1.6, losses=[12.0, 11.0, 10.0])
    rows = [{"host_step_gparams_per_s": 9.0, "host_wait_s": 9.0}] + [
        {"host_step_gparams_per_s": g, "host_wait_s": 0.3} for g in (4.0, 5.0, 6.0)
    ]
    write_point(tmp_path, 3, 8, "full", 2.0, rows, losses=[12.0, 11.25, 10.0])
    monkeypatch.setattr(sys, "argv", ["summary.py", str(tmp_path)])
    runpy.run_path(str(SUMMARY), run_name="__main__")
    out = capsys.readouterr().out
    assert "| 8 | full | ok | 2.000 | 1.25x |" in out and "| 1 | full | ok | 0.600 | 3.00x |" in out
    assert "| 5.00 | 300.0 |" in out  # the timed steps' medians (step 0 skipped)
    assert "offload=full at 8 micro-batches, target <= 1.25x none: 1.25x: met" in out
    # 0.4 s over 0.2 s per micro-batch: 1 + 0.4 / (A x 0.2) <= 1.25 from A = 8
    assert "extra s/step over none 0.400 at 1, 0.400 at 8; meets <= 1.25x from 8 micro-batches on (measured)" in out
    assert "needs 8 micro-batches" in out
    assert "- offload=full: largest |loss - none's| 0.2500 at 8 (3 steps)" in out  # at 1, no losses recorded
    assert "- offload=optimizer: losses not comparable" in out
