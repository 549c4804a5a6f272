"""Every preset under experiments/ composes through the package's config dir (the experiments:// search path of
conf/train.yaml), validates at the scale it was written for, records which preset it is, and runs once: on
the tiny model, on CPU, for 2 steps, on one rank or on two gloo ranks with EP 2 where the preset shards experts."""

from __future__ import annotations

import json
import os

import pytest
from omegaconf import OmegaConf

from moe_lab import config
from tests.configs import TINY, compose_train
from tests.in_turn import run_in_turn
from tests.sweep import ROOT

EXPERIMENTS = ROOT / "experiments"
# +experiment=<name>: experiments/<name>.yaml (shared), <study>/preset.yaml, <study>/<variant>.yaml
SHARED = {p.stem for p in EXPERIMENTS.glob("*.yaml")}  # settings the studies extend; they set no model of their own
PRESETS = sorted(
    [*SHARED]
    + [p.parent.name if p.name == "preset.yaml" else f"{p.parent.name}/{p.stem}" for p in EXPERIMENTS.glob("*/*.yaml")]
)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """For presets that read prepared tokens (data=tokens, made by their run.sh on the GPU machine): a small token
    directory with a sample of seq 16384 in each split and ids the tiny model's vocabulary holds."""
    import numpy as np

    from moe_lab.data.prepare import write_token_dir

    path = tmp_path_factory.mktemp("tokens")
    documents = ((split, (np.arange(9000) % 500).astype(np.uint32)) for split in ("train", "eval") for _ in range(2))
    write_token_dir(path, documents, {"tokenizer": "test", "vocab_size": 500, "eos_id": 0})
    return str(path)


@pytest.fixture(scope="module")
def compose_preset(tokens):
    def compose_it(name, *overrides):
        cfg = compose_train(f"+experiment={name}", *overrides)
        path = [f"data.path={tokens}"] if cfg.data._target_.endswith("TokenData") else []
        return compose_train(f"+experiment={name}", *overrides, *path, return_hydra_config=True)

    return compose_it


def test_presets_found():
    assert {
        "benchmark",
        "grid_30b",
        "grid_30b/two_gpu",
        "grid_30b/seq8192",
        "routing_skew",
        "reference_30b",
        "reference_235b",
        "real_routing",
        "real_routing/two_gpu",
        "grid_235b",
        "grid_235b/one_gpu",
    } <= set(PRESETS)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_composes_and_validates(name, compose_preset, monkeypatch):
    cfg = compose_preset(name, *(["model=qwen3_30b"] if name in SHARED else []))
    assert cfg.hydra.runtime.choices.experiment == name  # what a record's choices.experiment holds
    if cfg.parallel.ep > cfg.trainer.nproc_per_node:  # EP over an outer launcher's ranks (srun): the fewest it takes
        monkeypatch.setenv("WORLD_SIZE", str(cfg.parallel.ep))
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    config.validate(cfg)


def ranks_for(composed) -> list[str]:
    """One rank, or two gloo ranks with EP 2 where the preset shards experts."""
    return ["trainer.nproc_per_node=2", "parallel.ep=2"] if composed.parallel.ep > 1 else []


def distinct_tiny_runs() -> list[str]:
    """The presets whose tiny run differs from every earlier one's: presets that differ only in what TINY sets (the
    model, the sequence length) would run the same job, and each of them still composes and validates above."""
    runs, names = [], []
    for name in PRESETS:  # composed once each (at collection, in every worker): the rank overrides set plain values
        composed = compose_train(f"+experiment={name}", *TINY)
        for key, value in (override.split("=") for override in ranks_for(composed)):
            OmegaConf.update(composed, key, int(value))
        run = OmegaConf.to_container(composed)
        if run not in runs:
            runs.append(run)
            names.append(name)
    return names


TINY_RUNS = distinct_tiny_runs()


@pytest.fixture(scope="module")
def tiny_runs(compose_preset, tmp_path_factory) -> tuple[dict, str]:
    """Every distinct preset's tiny run: ``python -m moe_lab.train +experiment=<name> <TINY> ...`` each, run in turn
    in one process (tests/in_turn.py: one Python start and one torch import for all of them; the two-rank ones still
    start their ranks). Their run directories by name, and the process's output."""
    base = tmp_path_factory.mktemp("presets")
    commands, run_dirs = [], {}
    for name in TINY_RUNS:
        composed = compose_preset(name)
        data = [f"data.path={composed.data.path}"] if "path" in composed.data else []  # the fixture's tokens
        run_dirs[name] = base / name.replace("/", "-")
        commands.append([f"+experiment={name}", *TINY, *ranks_for(composed), *data, f"hydra.run.dir={run_dirs[name]}"])
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return run_dirs, run_in_turn(commands, cwd=base, timeout=900, env={**env, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("name", TINY_RUNS)
@pytest.mark.slow
def test_preset_runs_on_the_tiny_model(name, compose_preset, tiny_runs):
    run_dirs, output = tiny_runs
    result = run_dirs[name] / "result.json"
    assert result.exists(), output
    record = json.loads(result.read_text())
    assert record["status"] == "ok", output
    two_ranks = compose_preset(name).parallel.ep > 1
    assert record["choices"]["experiment"] == name and record["world_size"] == (2 if two_ranks else 1)
