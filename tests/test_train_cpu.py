"""The training entry point on CPU (issue 2, acceptance 4 and 6): the default job runs and records an ok result, the
tiny model learns the synthetic language, four ranks (EP=2, FSDP2) take the same steps as one, `--cfg job` allocates
nothing, a bad override exits naming its key, and dry-run parameter counts match the published model cards."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from moe_lab import config
from moe_lab.models.checkpoint import save_hf_checkpoint
from moe_lab.models.qwen3_moe import Qwen3MoeConfig

ROOT = Path(__file__).resolve().parents[1]


def train_cli(*overrides: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "moe_lab.train", *overrides], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


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
    assert "done: loss" in proc.stdout


def test_tiny_model_learns_synthetic_language(default_job):
    """A model that ignores context cannot beat ln(vocab) on uniformly spread tokens; the successor rule can."""
    losses = result(default_job[0])["metrics"]["losses"]
    chance = math.log(512)
    assert losses[0] == pytest.approx(chance, rel=0.05)
    assert sum(losses[-5:]) / 5 < 0.6 * chance, losses


def test_four_ranks_take_the_same_steps_as_one(tmp_path):
    """World 4 with EP=2 (experts split over 2 ranks and sharded over the other 2, dense weights sharded over all 4 by
    FSDP2) on the same global batch and initial weights as world 1: the same losses and clipped global gradient norms,
    step after step. (World 2 with EP=2 is compared with world 1 in test_ac.)"""
    torch.manual_seed(0)
    model = Qwen3MoeConfig().build()
    model.init_weights()
    save_hf_checkpoint(model.state_dict(), tmp_path / "init")
    common = ["trainer.steps=4", "trainer.warmup_steps=1", "trainer.grad_clip=0.5", f"trainer.init_checkpoint={tmp_path / 'init'}"]
    one = train_cli(*common, "data.batch_size=4", f"hydra.run.dir={tmp_path / 'one'}")
    four = train_cli(*common, "data.batch_size=1", "trainer.nproc_per_node=4", "parallel.ep=2", f"hydra.run.dir={tmp_path / 'four'}")
    assert one.returncode == 0, one.stderr[-3000:]
    assert four.returncode == 0, four.stderr[-3000:]
    assert result(tmp_path / "four")["world_size"] == 4
    rows = {}
    for name in ("one", "four"):
        rows[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in rows["four"]] == pytest.approx([r["loss"] for r in rows["one"]], rel=1e-5)
    assert [r["grad_norm"] for r in rows["four"]] == pytest.approx([r["grad_norm"] for r in rows["one"]], rel=1e-4)
    assert rows["one"][0]["grad_norm"] > 0.5  # clipping was active


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
def test_dry_run_parameter_counts_match_model_cards(model, capsys, tmp_path):
    from moe_lab.train import run_job

    config.register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=[f"model={model}", "trainer.dry_run=true"])
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
