"""The training entry point on CPU (issue 2, acceptance 4 and 6): the default job runs and records an ok result, the
tiny model learns the synthetic language, `--cfg job` allocates nothing, a bad override exits naming its key, and
dry-run parameter counts match the published model cards. (Multi-rank jobs: tests/test_distributed_training.py.)"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest

from tests import cli

ROOT = Path(__file__).resolve().parents[1]


def train_cli(*overrides: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return cli.train_cli(*overrides, cwd=cwd, env=env)  # forked from the forkserver: tests/cli.py


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


@pytest.fixture(scope="module")
def default_job(tmp_path_factory):
    """The README's first command, 50 steps instead of 100."""
    run_dir = tmp_path_factory.mktemp("default")
    proc = train_cli("trainer.steps=50", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir, proc


def test_default_job_records_ok_result(default_job):
    run_dir, proc = default_job
    record = result(run_dir)
    assert record["status"] == "ok" and record["error"] is None
    assert record["choices"]["model"] == "tiny" and record["choices"]["dispatcher"] == "torch"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(50))
    metrics = record["metrics"]
    assert metrics["losses"] == [r["loss"] for r in rows]
    assert metrics["s_per_step"] > 0 and metrics["tokens_per_s_per_gpu"] > 0
    assert metrics["mfu"] is None  # on CPU MFU is not invented
    assert metrics["timed_steps"] == 48 and metrics["timed_warmup"] is False  # trainer.timing_skip=2 left out
    assert "done: loss" in proc.stdout and "warm-up steps included" not in proc.stdout


def test_a_run_shorter_than_its_timing_skip_says_its_time_includes_warm_up(tmp_path):
    proc = train_cli(
        "trainer.steps=2", "data.seq_len=16", "data.batch_size=1", f"hydra.run.dir={tmp_path}", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = result(tmp_path)["metrics"]
    assert metrics["timed_steps"] == 2 and metrics["timed_warmup"] is True and metrics["s_per_step"] > 0
    assert "s/step (warm-up steps included: no more steps ran than trainer.timing_skip)" in proc.stdout


def test_tiny_model_learns_synthetic_language(default_job):
    """A model that ignores context cannot beat ln(vocab) on uniformly spread tokens; the successor rule can."""
    losses = result(default_job[0])["metrics"]["losses"]
    chance = math.log(512)
    assert losses[0] == pytest.approx(chance, rel=0.05)
    assert sum(losses[-5:]) / 5 < 0.6 * chance, losses


def test_cfg_job_prints_without_running(tmp_path):
    proc = train_cli("model=qwen3_235b", "--cfg", "job", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "num_layers: 94" in proc.stdout and "hidden_size: 4096" in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no run directory: nothing was built


def test_bad_override_exits_naming_its_key(tmp_path):
    proc = train_cli("parallel.ep=3", f"hydra.run.dir={tmp_path}")
    assert proc.returncode != 0
    assert "invalid config: parallel.ep:" in proc.stderr
    record = result(tmp_path)
    assert record["status"] == "invalid" and record["error"]["key"] == "parallel.ep"


# Published totals / activated parameters (model cards) and non-embedding totals (model cards: 29.9B, 234B).
# The 30B card's "3.3B activated" is truncated: the config.json shapes give 3.353B, which is 1.6 % above it.
PUBLISHED = {"qwen3_30b": (30.5e9, 3.3e9, 29.9e9), "qwen3_235b": (235e9, 22e9, 234e9)}


@pytest.mark.parametrize("model", sorted(PUBLISHED))
def test_dry_run_parameter_counts_match_model_cards(model, capsys, tmp_path, compose_train):
    from moe_lab.job.lifecycle import run_job

    cfg = compose_train(f"model={model}", "trainer.dry_run=true")
    summary = run_job(cfg, tmp_path, meta={})
    total, active, non_embedding = PUBLISHED[model]
    embeddings = 2 * cfg.model.vocab_size * cfg.model.hidden_size  # input table and untied LM head
    assert summary["total_params"] == pytest.approx(total, rel=0.01)
    assert summary["total_params"] - embeddings == pytest.approx(non_embedding, rel=0.01)
    if model == "qwen3_30b":
        assert int(summary["active_params"] / 1e8) == 33  # "3.3B", truncated
    else:
        assert summary["active_params"] == pytest.approx(active, rel=0.01)
    assert "total" in capsys.readouterr().out
