"""``trainer.deterministic``: what it switches (and switches back for a sweep's next point), what validation refuses,
that moe_lab's kernels keep needing no deterministic variant of their own (no atomics), two deterministic CPU runs
bit for bit (``moe_lab.compare --assert-equal``); on a GPU (``gpu`` marker): two deterministic runs bit for bit,
and a run killed after a checkpoint and resumed, bit for bit with the flag and inside the noise band without it."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from moe_lab import compare, config
from moe_lab.config.validate import validate
from moe_lab.runtime import determinism
from moe_lab.runtime.errors import ConfigError
from moe_lab.runtime.paths import CONF_DIR
from tests import cli

ROOT = Path(__file__).resolve().parents[1]


def test_set_determinism_switches_on_and_back_off(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    import torch._inductor.config as inductor

    try:
        determinism.set_determinism(True, seed=7)
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == determinism.CUBLAS_WORKSPACE_CONFIG
        assert inductor.deterministic
        drawn = torch.rand(3)
        determinism.set_determinism(True, seed=7)
        assert torch.equal(torch.rand(3), drawn)  # the global generator seeded afresh
    finally:
        determinism.set_determinism(False, seed=0)
    assert not torch.are_deterministic_algorithms_enabled() and not inductor.deterministic


def test_compile_without_inductors_deterministic_mode_is_refused(monkeypatch):
    config.register()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(determinism, "inductor_has_deterministic_mode", lambda: False)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(
            config_name="train",
            overrides=["trainer.deterministic=true", "trainer.compile=true", "trainer.precision=bf16"],
        )
        with pytest.raises(ConfigError) as refused:
            validate(cfg)
        assert refused.value.key == "trainer.deterministic" and "Inductor's deterministic mode" in str(refused.value)
        validate(compose(config_name="train", overrides=["trainer.deterministic=true"]))  # eager: fine


def test_moe_kernels_use_no_atomics():
    """Every reduction in moe_lab's Triton kernels is in a fixed order: an atomic would need a deterministic variant
    selected by trainer.deterministic (and this test a comparison of the two under the interpreter)."""
    sources = [p for p in (ROOT / "moe_lab").rglob("*.py") if "@triton.jit" in p.read_text()]
    assert sources  # the fused op's kernels at least
    for path in sources:
        assert not re.search(r"\btl\.atomic_\w+", path.read_text()), f"{path}: an atomic in a Triton kernel"


def train(args: list[str], env_extra: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))  # keep what the caller's holds
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(key, None)
    done = cli.train_cli(*args, cwd=ROOT, env=env, timeout=1200)  # forked from the forkserver on a CPU machine
    if check:
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_two_deterministic_cpu_runs_are_bitwise_equal(tmp_path):
    common = [
        "trainer.deterministic=true",
        "trainer.steps=4",
        "trainer.warmup_steps=1",
        "data.seq_len=16",
        "data.batch_size=2",
        "dispatcher=fused",
    ]
    for name in ("a", "b"):
        train([*common, f"hydra.run.dir={tmp_path / name}"])
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--assert-equal"]) == 0


# --- on a GPU ------------------------------------------------------------------------------------------------------

# A small shape the fused gpu backend runs with torch._grouped_mm (DeepGEMM needs multiples of 128), bf16, compiled,
# learned routing; 12 steps, a checkpoint at 6.
GPU_RUN = [
    "trainer.device=cuda",
    "trainer.compile=true",
    "dispatcher=fused",
    "dispatcher.gemm=torch",
    "model.hidden_size=256",
    "model.moe_intermediate_size=128",
    "model.num_experts=16",
    "model.num_experts_per_tok=4",
    "data.seq_len=256",
    "data.batch_size=4",
    "trainer.steps=12",
    "trainer.warmup_steps=2",
    "trainer.checkpoint.every=6",
]


def killed_and_resumed(tmp_path: Path, args: list[str]) -> Path:
    """A run held at step 8 (two steps past its step-6 checkpoint), killed, and run again in the same directory."""
    from tests.pausing_data import PAUSE
    from tests.test_resume import Job, paused

    run_dir, pause_dir = tmp_path / "resumed", tmp_path / "pause"
    full = [*args, "data._target_=tests.pausing_data.PausingData", f"hydra.run.dir={run_dir}"]
    job = Job(full, tmp_path, pause=f"8:{pause_dir}")
    job.wait_for(paused(pause_dir, 1), timeout=600)
    job.kill()
    assert not (run_dir / "result.json").exists()
    env = {PAUSE: ""}
    train(full, env)
    return run_dir


@pytest.mark.gpu
def test_two_deterministic_gpu_runs_and_a_resumed_one_are_bitwise_equal(tmp_path):
    args = [*GPU_RUN, "trainer.deterministic=true", "data._target_=tests.pausing_data.PausingData"]
    for name in ("a", "b"):
        train([*args, f"hydra.run.dir={tmp_path / name}"])
    assert compare.main([str(tmp_path / "a"), str(tmp_path / "b"), "--assert-equal"]) == 0
    resumed = killed_and_resumed(tmp_path, [*GPU_RUN, "trainer.deterministic=true"])
    assert compare.main([str(tmp_path / "a"), str(resumed), "--assert-equal"]) == 0


@pytest.mark.gpu
def test_a_resumed_gpu_run_stays_inside_the_noise_band(tmp_path):
    args = [*GPU_RUN, "data._target_=tests.pausing_data.PausingData"]
    for name in ("a", "b"):
        train([*args, f"hydra.run.dir={tmp_path / name}"])
    resumed = killed_and_resumed(tmp_path, GPU_RUN)
    # The band: how far two uninterrupted runs drift apart, three times over (one repeat shows a sample of the noise,
    # not its range; a resumed run is one more sample).
    assert compare.main([str(tmp_path / "a"), str(resumed), "--noise", str(tmp_path / "b"), "--noise-factor", "3"]) == 0
