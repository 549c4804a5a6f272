"""Issue 3, acceptance 2: ``trainer.compile=true`` (each decoder block compiled with fullgraph=True, after AC, before
FSDP) trains like eager under ac=none, selective and full, and the compiled selective policy keeps the exchange's
outputs instead of re-communicating. Run where compile has the most to get through: 2 gloo ranks with ep 2, so every
block holds a dispatcher's custom ops with data-dependent sizes (the torch dispatcher's all-to-alls; the fused op,
reference backend on CPU, whose residuals have as many rows as the rank receives) and FSDP2 on two meshes. On one
rank: every block runs as one compiled graph, and so does the loss's work; the torch dispatcher's compile is refused
outside bf16.

bf16 (torch._grouped_mm compiles in bf16 only); inductor fuses elementwise work differently from eager, so losses
agree to bf16 rounding: relative 2e-3 over 3 steps (they differ by about 1e-5 in practice).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.utils import instantiate

from moe_lab import config
from moe_lab.models.hf_weights import load_hf_checkpoint, save_hf_checkpoint
from moe_lab.models.loss import ChunkedLoss, FullLoss
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from moe_lab.moe.dispatcher import FusedDispatcher
from moe_lab.parallel import compile_loss, parallelize
from moe_lab.parallel.compile import apply_compile
from moe_lab.parallel.expert_parallel import apply_expert_parallel
from moe_lab.runtime.errors import ConfigError
from tests.configs import compose_train
from tests.distributed import run_world

LAYERS = 2  # the tiny model
MODES = (("none", False), ("none", True), ("selective", True), ("full", True))  # (ac, compiled)


def can_compile() -> str | None:
    """Why inductor cannot compile here, or None."""
    try:
        torch.compile(lambda x: x * 2, fullgraph=True)(torch.ones(2))
    except Exception as e:  # no C++ compiler, unsupported platform
        return f"torch.compile does not work on this platform: {type(e).__name__}: {e}"
    return None


def train(dispatcher: str, ac: str, compiled: bool, checkpoint: str, extra: tuple = ()) -> dict:
    """3 steps on this rank's share of the global batch; the loss (mean over ranks) and the all-to-alls run during
    each forward and each backward. ``extra``: more overrides (the model's among them must match the checkpoint's)."""
    overrides = [
        f"dispatcher={dispatcher}",
        f"ac={ac}",
        f"trainer.compile={str(compiled).lower()}",
        "trainer.precision=bf16",
        "parallel.ep=2",
        "data.seq_len=32",
        "data.batch_size=2",
        *extra,
    ]
    cfg = compose_train(*overrides)
    with torch.device("meta"):
        model = instantiate(cfg.model).build()
    options = config.build_options(cfg)
    parallelize(
        model,
        options.dispatcher,
        options.ac,
        ep=cfg.parallel.ep,
        compile=cfg.trainer.compile,
        device=torch.device("cpu"),
        compute_dtype=torch.bfloat16,
    )
    model.to_empty(device="cpu")
    load_hf_checkpoint(model, checkpoint)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = instantiate(cfg.data)

    calls = 0
    all_to_all_single = dist.all_to_all_single

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        return all_to_all_single(*args, **kwargs)

    losses, forward_a2a, backward_a2a = [], [], []
    dist.all_to_all_single = counted  # what moe_lab.moe.collectives and the fused reference backend call
    try:
        for step in range(3):
            batch = data.batch(step, dist.get_rank(), dist.get_world_size())
            inputs, labels = batch.inputs, batch.labels
            calls = 0
            loss = F.cross_entropy(model(inputs).logits.float().flatten(0, 1), labels.flatten())
            forward_a2a.append(calls)
            calls = 0
            loss.backward()
            backward_a2a.append(calls)
            optimizer.step()
            optimizer.zero_grad()
            loss = loss.detach()
            dist.all_reduce(loss)
            losses.append(loss.item() / dist.get_world_size())
    finally:
        dist.all_to_all_single = all_to_all_single
    return {"losses": losses, "forward_a2a": forward_a2a, "backward_a2a": backward_a2a}


def train_all(dispatcher: str, checkpoint: str, extra: tuple = ()) -> dict:
    return {(ac, compiled): train(dispatcher, ac, compiled, checkpoint, extra) for ac, compiled in MODES}


def config_model(overrides: tuple = ()):
    """The default (tiny) model's config, as conf/ composes it (with ``overrides``)."""
    return instantiate(compose_train(*overrides).model)


@pytest.mark.parametrize("dispatcher", ["torch", "fused"])
@pytest.mark.slow
def test_compiled_blocks_train_like_eager(dispatcher, tmp_path):
    if reason := can_compile():
        pytest.skip(reason)
    torch.manual_seed(0)
    model = config_model().build()
    model.init_weights()
    save_hf_checkpoint(model.state_dict(), tmp_path)

    runs = run_world(2, train_all, dispatcher, str(tmp_path))[0]

    eager = runs[("none", False)]
    assert eager["losses"][-1] < eager["losses"][0]
    for ac, compiled in MODES[1:]:
        assert runs[(ac, compiled)]["losses"] == pytest.approx(eager["losses"], rel=2e-3), ac
    # Backward communicates what the forward's gradients need; full AC re-runs every forward exchange on top
    # (torch dispatcher per block: 3 forward, 2 backward), selective none of them.
    forward, backward = eager["forward_a2a"][0], eager["backward_a2a"][0]
    assert forward > 0 and backward > 0
    expected = {"none": backward, "selective": backward, "full": backward + forward}
    for (ac, _), run in runs.items():
        assert run["forward_a2a"] == [forward] * 3, f"ac={ac}: all-to-alls in forward {run['forward_a2a']}"
        assert run["backward_a2a"] == [expected[ac]] * 3, f"ac={ac}: all-to-alls in backward {run['backward_a2a']}"
    if dispatcher == "torch":
        assert (forward, backward) == (3 * LAYERS, 2 * LAYERS)


def counting_graphs(monkeypatch) -> list:
    """torch.compile with a backend that runs dynamo's graphs as they are: returns the list each run appends to."""
    graphs_run = []

    def counting(graph, example_inputs):
        def run(*args):
            graphs_run.append(graph)
            return graph(*args)

        return run

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend=counting))
    return graphs_run


def test_every_block_runs_as_one_compiled_graph(monkeypatch):
    """apply_compile compiles each decoder block's forward whole: a forward of the tiny model runs one graph per
    block, and gives the eager logits; the parameters keep their names."""
    graphs_run = counting_graphs(monkeypatch)
    torch.manual_seed(0)
    model = Qwen3MoeConfig.preset("tiny").build()
    model.init_weights()
    apply_expert_parallel(model, FusedDispatcher(backend="reference"), 0, 1)  # compiles in fp32 on the CPU
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        eager = model(tokens).logits
        apply_compile(model)
        compiled = model(tokens).logits
    assert len(graphs_run) == LAYERS
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
    assert [name for name, _ in model.named_parameters()] == names


@pytest.mark.parametrize("loss", [FullLoss(), ChunkedLoss(16)], ids=["full", "chunked"])
def test_compile_loss_runs_the_losss_work_compiled(monkeypatch, loss):
    """compile_loss (trainer.compile's loss) runs its work over the vocabulary as compiled graphs, to the eager
    loss."""
    graphs_run = counting_graphs(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(2, 24, 16, generator=gen), torch.randn(40, 16, generator=gen)
    labels = torch.randint(0, 40, (2, 24), generator=gen)
    eager = loss(hidden, weight, labels)
    assert not graphs_run
    torch.testing.assert_close(compile_loss(loss)(hidden, weight, labels), eager, rtol=1e-5, atol=1e-6)
    assert graphs_run


def test_compile_with_the_torch_dispatcher_is_refused_outside_bf16():
    """torch._grouped_mm compiles in bf16 only: trainer.compile=true with the torch dispatcher is refused at fp32,
    naming trainer.precision, and accepted at bf16."""
    overrides = ("dispatcher=torch", "trainer.compile=true", "trainer.device=cpu")
    with pytest.raises(ConfigError) as error:
        config.validate(compose_train(*overrides, "trainer.precision=fp32"))
    assert error.value.key == "trainer.precision" and "bf16" in str(error.value)
    config.validate(compose_train(*overrides, "trainer.precision=bf16"))
