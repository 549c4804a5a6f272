"""Issue 3, acceptance 1: every mesh shape trains like one rank. The same global batch (SyntheticData gives any world
the same one) from the same weights gives the same losses and the same global gradient norms over 5 steps at world 1,
world 2 as ep 2, world 2 as dp_shard 2, world 4 as dp_shard 2 x ep 2, and world 4 as ep 4. The same weights come from
one Hugging Face checkpoint for some worlds and from the same seed alone for the others (issue 14: the seed gives the
same initial weights on every mesh shape; the checkpoint holds the weights seed 0 gives one rank).

Each world is a real job, ``python -m moe_lab.train`` starting its gloo ranks itself (the five run in turn in one
process, tests/in_turn.py). Clipping is on at a norm below
the gradients' (moe_lab.train.clip_grad_norm), so the losses also depend on the scale of every gradient, which
AdamW alone would hide; the logged global norm checks each gradient's scale directly.
Tolerance: fp32 throughout, only the summation order differs between worlds: relative 1e-5.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_lab.models.hf_weights import save_hf_checkpoint
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from tests.in_turn import run_in_turn

pytestmark = pytest.mark.slow  # every mesh shape as gloo worlds of 2 and 4

ROOT = Path(__file__).resolve().parents[1]
GLOBAL_BATCH = 4
WORLDS = {  # name: (ranks, ep, starts from the checkpoint)
    "world1": (1, 1, True),
    "world2_ep2": (2, 2, False),
    "world2_dp2": (2, 1, True),
    "world4_dp2_ep2": (4, 2, False),
    "world4_ep4": (4, 4, False),  # a real EP=4 all-to-all (issue 16's shape, on CPU)
}


def job_args(run_dir: Path, ranks: int, ep: int, checkpoint: Path | None) -> list[str]:
    return [
        f"hydra.run.dir={run_dir}",
        f"trainer.nproc_per_node={ranks}",
        f"parallel.ep={ep}",
        f"data.batch_size={GLOBAL_BATCH // ranks}",
        "data.seq_len=32",
        "trainer.steps=5",
        "trainer.warmup_steps=1",
        "trainer.grad_clip=0.3",
        "trainer.device=cpu",
        "trainer.precision=fp32",
        "trainer.seed=0",
        *([f"trainer.init_checkpoint={checkpoint}"] if checkpoint else []),
    ]


def job_result(run_dir: Path, ranks: int, output: str) -> dict:
    assert (run_dir / "result.json").exists(), output
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["world_size"] == ranks, output
    norms = [json.loads(line)["grad_norm"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"losses": result["metrics"]["losses"], "grad_norms": norms}


def test_mesh_shapes_train_like_one_rank(tmp_path):
    model = Qwen3MoeConfig.preset("tiny").build()
    model.init_weights(seed=0)
    save_hf_checkpoint(model.state_dict(), tmp_path / "init")

    commands = [
        job_args(tmp_path / name, ranks, ep, tmp_path / "init" if from_checkpoint else None)
        for name, (ranks, ep, from_checkpoint) in WORLDS.items()
    ]
    output = run_in_turn(commands, cwd=ROOT, timeout=600)  # in one process, each as its command line would run it
    runs = {name: job_result(tmp_path / name, ranks, output) for name, (ranks, _, _) in WORLDS.items()}

    reference = runs.pop("world1")
    assert len(reference["losses"]) == 5
    assert all(norm > 0.3 for norm in reference["grad_norms"]), "clipping must be active for the test to see scales"
    for name, run in runs.items():
        assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5), name
        assert run["grad_norms"] == pytest.approx(reference["grad_norms"], rel=1e-5), name


def _first_expert_rows(device_type: str, world: int) -> list[float]:
    from moe_lab import config
    from moe_lab.job.trainer import build_model
    from moe_lab.parallel.sharding import local_shard
    from tests.configs import compose_train

    cfg = compose_train(f"parallel.ep={world}")
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    model = build_model(cfg, config.build_options(cfg), device, torch.float32)
    return local_shard(model.model.layers[0].mlp.experts.gate_up_proj)[0, 0, :8].cpu().tolist()


def _assert_distinct_experts(device_type: str, backend: str) -> None:
    from tests.distributed import run_world

    rows = run_world(2, _first_expert_rows, device_type, 2, backend=backend)
    assert rows[0] != rows[1], "EP ranks start from equal experts"


def test_ep_ranks_start_from_different_experts():
    """Each EP rank's local experts are its own draw, not a copy of another rank's (they are separate tensors of one
    shape: a random op seeded alike on every rank would repeat the first rank's experts on the others)."""
    _assert_distinct_experts("cpu", "gloo")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ep_ranks_start_from_different_experts_on_gpu():
    _assert_distinct_experts("cuda", "nccl")  # where DTensor's random ops would sync every rank to rank 0's seed
