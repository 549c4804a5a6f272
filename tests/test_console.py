"""What the console says of where things went (issue 40): ``python -m moe_lab.plan`` prints the path of its record,
and exits 0 for a plan that does not fit (``fits: false``), 1 for a config train would refuse."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests import cli

ROOT = Path(__file__).resolve().parents[1]


def plan_cli(*args: str, cwd: Path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(ROOT)
    return cli.train_cli(*args, cwd=cwd, env=env, script=str(ROOT / "moe_lab" / "plan" / "__main__.py"))


def test_plan_prints_its_record_and_exits_0_for_a_plan_that_fits_nowhere(tmp_path):
    run_dir = tmp_path / "plan"
    proc = plan_cli("model=qwen3_30b", "hardware.gpus_per_node=1", f"hydra.run.dir={run_dir}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"recorded in {run_dir / 'result.json'}" in proc.stdout and "does not fit" in proc.stdout
    assert "fastest that fits here: none (" in proc.stdout  # said, not left out
    assert json.loads((run_dir / "result.json").read_text())["plan"]["fits"] is False

    refused = plan_cli("parallel.ep=3", f"hydra.run.dir={tmp_path / 'invalid'}", cwd=tmp_path)
    assert refused.returncode == 1
    assert f"(recorded in {tmp_path / 'invalid' / 'result.json'})" in refused.stderr


def test_the_docs_list_every_study_preset():
    """docs/config-and-groups.md's experiment row and docs/sweeps-and-records.md's preset list name every preset
    and variant under experiments/ (a new study's preset is listed where a user looks for it)."""
    from moe_lab.runtime.paths import EXPERIMENTS_DIR

    presets = [p.parent.name for p in EXPERIMENTS_DIR.glob("*/preset.yaml")]
    presets += [f"{p.parent.name}/{p.stem}" for p in EXPERIMENTS_DIR.glob("*/*.yaml") if p.name != "preset.yaml"]
    groups = next(
        line
        for line in (ROOT / "docs" / "config-and-groups.md").read_text().splitlines()
        if line.startswith("| `experiment` |")
    )
    sweeps = (ROOT / "docs" / "sweeps-and-records.md").read_text()
    for preset in presets:
        assert f"`{preset}`" in groups, f"docs/config-and-groups.md lacks {preset}"
        assert f"`{preset}`" in sweeps, f"docs/sweeps-and-records.md lacks {preset}"
