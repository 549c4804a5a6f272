"""The loss group (moe_lab.models.loss): loss=chunked gives the loss and the gradients of loss=full, which is the LM
head's logits and ``lm_loss`` (the fp32 cross-entropy the trainer used before the group), within fp32 rounding on the
CPU and bf16 rounding in bf16 (the head's weight gradient is summed over chunks in fp32, each chunk's share rounded to
bf16 once); in evaluation (no gradients), compiled, through the model, under FSDP2 on two gloo ranks, and on CUDA
(``gpu`` marker), where it also holds a chunk's logits instead of all of them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_lab import config
from moe_lab.config import ConfigError
from moe_lab.models.loss import IGNORE_INDEX, ChunkedLoss, FullLoss, lm_loss
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from tests.configs import compose_train
from tests.distributed import run_world
from tests.test_compile import can_compile

B, S, H, V = 2, 37, 16, 300  # 74 tokens: chunks of 7 leave a short last one


def problem(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, S, H, generator=gen).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(V, H, generator=gen)).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (B, S), generator=gen)
    return hidden, weight, labels


def today(hidden, weight, labels):
    """The loss as the trainer computed it before the loss group: the head's logits, then ``lm_loss``."""
    return lm_loss(F.linear(hidden, weight), labels)


def loss_and_grads(loss_fn, hidden, weight, labels, scale=1.0):
    loss = loss_fn(hidden, weight, labels)
    return [loss.detach(), *torch.autograd.grad(scale * loss, (hidden, weight))]


def relative(got, expected):
    return ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


@pytest.mark.parametrize("chunk_tokens", [5, 7, 74, 4096])
def test_chunked_gives_todays_loss_and_gradients_in_fp32(chunk_tokens):
    hidden, weight, labels = problem()
    expected = loss_and_grads(today, hidden, weight, labels, scale=0.25)  # the step's 1 / grad_accum
    got = loss_and_grads(ChunkedLoss(chunk_tokens), hidden, weight, labels, scale=0.25)
    assert got[0].dtype == torch.float32 and got[0].shape == ()
    for name, g, e in zip(("loss", "d hidden", "d weight"), got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape, name
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("loss_fn", [FullLoss(), ChunkedLoss(7)], ids=["full", "chunked"])
def test_ignored_labels_count_in_no_mean(loss_fn):
    """Labels of -100 (a data option's masked tokens) are left out of the mean, its gradients zero in their rows:
    the mean over the other tokens alone, in training and in evaluation; with every label ignored the loss is nan and
    the gradients zero (as ``F.cross_entropy`` gives them: one such micro-batch writes no nan into the weights)."""
    hidden, weight, labels = problem()
    ignored = torch.zeros_like(labels, dtype=torch.bool)
    ignored[:, ::3] = True
    masked = labels.masked_fill(ignored, IGNORE_INDEX)
    kept = ~ignored.flatten()
    expected_loss = F.cross_entropy(F.linear(hidden, weight).double().flatten(0, 1)[kept], labels.flatten()[kept])
    got = loss_and_grads(loss_fn, hidden, weight, masked)
    torch.testing.assert_close(got[0].double(), expected_loss, rtol=1e-5, atol=1e-7)
    expected_hidden, expected_weight = torch.autograd.grad(expected_loss, (hidden, weight))
    torch.testing.assert_close(got[1], expected_hidden.float(), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got[2], expected_weight.float(), rtol=1e-5, atol=1e-7)
    assert got[1].flatten(0, 1)[~kept].abs().max() == 0
    with torch.no_grad():
        torch.testing.assert_close(loss_fn(hidden, weight, masked).double(), expected_loss, rtol=1e-5, atol=1e-7)
        assert loss_fn(hidden, weight, torch.full_like(labels, IGNORE_INDEX)).isnan()
    nothing_counted = loss_and_grads(loss_fn, hidden, weight, torch.full_like(labels, IGNORE_INDEX))
    assert nothing_counted[0].isnan()
    assert all(torch.equal(g, torch.zeros_like(g)) for g in nothing_counted[1:])


def test_full_is_todays_loss():
    hidden, weight, labels = problem()
    for g, e in zip(loss_and_grads(FullLoss(), hidden, weight, labels), loss_and_grads(today, hidden, weight, labels)):
        assert torch.equal(g, e)


@pytest.mark.parametrize("chunk_tokens", [16, 4])
def test_chunked_in_bf16_is_todays_within_bf16_rounding(chunk_tokens):
    """FSDP2's case: bf16 hidden states and weight, no autocast: bf16 gradients, the weight's within a bf16 ulp or
    two of the one GEMM's (each chunk's share rounded once before the fp32 sum; at 4 tokens a chunk, a sum kept in
    bf16 would be 3 ulps off)."""
    hidden, weight, labels = problem(torch.bfloat16)
    expected = loss_and_grads(today, hidden, weight, labels)
    got = loss_and_grads(ChunkedLoss(chunk_tokens), hidden, weight, labels)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=1e-6)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    assert torch.equal(got[1], expected[1])  # each token's gradient comes from its own chunk alone
    assert relative(got[2], expected[2]) < 2 * 2**-8


def test_chunked_under_autocast_casts_as_a_linear_does():
    """One rank: fp32 weights under bf16 autocast; the head runs in bf16 and the gradients come back in fp32."""
    hidden, weight, labels = problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected_loss, got_loss = today(hidden, weight, labels), ChunkedLoss(16)(hidden, weight, labels)
    expected = torch.autograd.grad(expected_loss, (hidden, weight))
    got = torch.autograd.grad(got_loss, (hidden, weight))
    torch.testing.assert_close(got_loss, expected_loss, rtol=1e-5, atol=1e-6)
    assert got[0].dtype == got[1].dtype == torch.float32
    assert torch.equal(got[0], expected[0])
    assert relative(got[1], expected[1]) < 2 * 2**-8


def test_chunked_evaluates_without_gradients():
    hidden, weight, labels = problem()
    with torch.no_grad():
        got = ChunkedLoss(7)(hidden, weight, labels)
        expected = today(hidden, weight, labels)
    assert not got.requires_grad
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_chunked_with_a_frozen_head_differentiates_the_hidden_states_only():
    hidden, weight, labels = problem()
    weight.requires_grad_(False)
    (expected,) = torch.autograd.grad(today(hidden, weight, labels), hidden)
    (got,) = torch.autograd.grad(ChunkedLoss(7)(hidden, weight, labels), hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_a_second_backward_fails_loudly():
    """Backward scales the gradients forward left in place: a second one through a retained graph is refused."""
    hidden, weight, labels = problem()
    loss = ChunkedLoss(7)(hidden, weight, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


@pytest.mark.parametrize("loss_fn", [FullLoss(), ChunkedLoss(16)], ids=["full", "chunked"])
def test_compiled_loss_equals_eager(loss_fn):
    if reason := can_compile():
        pytest.skip(reason)
    from moe_lab.parallel import compile_loss

    hidden, weight, labels = problem(torch.bfloat16)
    eager = loss_and_grads(loss_fn, hidden, weight, labels)
    compiled = loss_and_grads(compile_loss(loss_fn), hidden, weight, labels)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-6)
    for g, e in zip(compiled[1:], eager[1:]):
        assert relative(g, e) < 2 * 2**-8
    with torch.no_grad():
        torch.testing.assert_close(compile_loss(loss_fn)(hidden, weight, labels), eager[0], rtol=1e-5, atol=1e-6)


def test_the_model_hands_the_loss_its_head():
    """model(inputs, labels=, loss=) gives the loss and every parameter's gradient of lm_loss over its logits."""
    torch.manual_seed(0)
    model = Qwen3MoeConfig.preset("tiny").build()
    model.init_weights()
    tokens = torch.randint(0, model.config.vocab_size, (2, 33))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def grads(out_loss):
        model.zero_grad()
        out_loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    expected_loss = lm_loss(model(inputs).logits, labels)
    expected = grads(expected_loss)
    out = model(inputs, labels=labels, loss=ChunkedLoss(chunk_tokens=10))
    assert out.logits is None
    torch.testing.assert_close(out.loss, expected_loss, rtol=1e-6, atol=1e-7)
    got = grads(out.loss)
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


def fsdp_gradients(loss: str) -> dict:
    """One forward and backward of the tiny model on this rank's mesh (FSDP2 over 2 gloo ranks, EP 2) as the trainer
    builds and calls it, with ``loss``: the loss and this rank's gradient shards."""
    import torch.distributed as dist

    from moe_lab.job.trainer import build_model
    from moe_lab.parallel.sharding import local_shard

    chunks = ["loss.chunk_tokens=24"] if loss == "chunked" else []  # 4 x 128 tokens a rank
    cfg = compose_train(f"loss={loss}", *chunks, "trainer.nproc_per_node=2", "parallel.ep=2")
    options = config.validate(cfg)
    model = build_model(cfg, options, torch.device("cpu"), torch.float32)
    batch = options.data.batch(0, dist.get_rank(), 2)
    out = model(batch.inputs, batch.documents, labels=batch.labels, loss=options.loss)
    out.loss.backward()
    grads = {n: local_shard(p.grad).numpy().copy() for n, p in model.named_parameters()}
    return {"loss": out.loss.item(), "grads": grads}


def test_chunked_under_fsdp2_gives_fulls_gradients():
    full, chunked = (run_world(2, fsdp_gradients, loss) for loss in ("full", "chunked"))
    for rank in range(2):
        assert chunked[rank]["loss"] == pytest.approx(full[rank]["loss"], rel=1e-6)
        assert chunked[rank]["grads"].keys() == full[rank]["grads"].keys()
        for name, expected in full[rank]["grads"].items():
            torch.testing.assert_close(
                torch.from_numpy(chunked[rank]["grads"][name]), torch.from_numpy(expected), rtol=1e-5, atol=1e-7
            )


def test_chunk_tokens_below_one_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as error:
        config.validate(compose_train("loss=chunked", "loss.chunk_tokens=0"))
    assert error.value.key == "loss.chunk_tokens"


# --- the planner ----------------------------------------------------------------------------------------------------
FULL_DEPTH = ["+experiment=full_depth", "hardware=h200", "hardware.gpus_per_node=1", "ac=selective"]


def planned_step(*overrides):
    from moe_lab.plan.config import compose
    from moe_lab.plan.planner import build_hardware, step_of, validated

    cfg = compose(FULL_DEPTH + list(overrides))
    hw = build_hardware(cfg.hardware)
    return step_of(*validated(cfg, hw), hw), hw


def test_the_planner_plans_the_built_loss():
    """The plan's loss line follows the loss option and its chunk size, as built: all logits and their gradient in
    bf16 (full), or one chunk's beside the head's fp32 weight-gradient sum and bf16 share, and the hidden states'
    gradient (chunked)."""
    from moe_lab.plan.memory import GIB, plan_memory
    from moe_lab.plan.models.loss import ChunkedLossPlan, FullLossPlan

    t, v, h = 16384, 151936, 2048
    lines = {}
    for overrides in (["loss=full"], ["loss=chunked"], ["loss=chunked", "loss.chunk_tokens=8192"]):
        step, _ = planned_step(*overrides)
        lines[" ".join(overrides)] = plan_memory(step).categories["loss"]
    assert isinstance(planned_step("loss=full")[0].loss, FullLossPlan)
    assert isinstance(planned_step("loss=chunked")[0].loss, ChunkedLossPlan)
    assert lines["loss=full"] == 4 * t * v
    chunked = lambda chunk: 4 * v * h + 2 * t * h + 4 * chunk * v  # noqa: E731
    assert lines["loss=chunked"] == chunked(4096) and lines["loss=chunked loss.chunk_tokens=8192"] == chunked(8192)
    assert (lines["loss=full"] - lines["loss=chunked"]) / GIB > 5  # what seq 16384 gets back


def test_one_chunk_holds_what_full_holds_and_the_gradients_it_made():
    from moe_lab.plan.models.loss import ChunkedLossPlan, FullLossPlan

    t, h, v = 4096, 2048, 151936
    assert ChunkedLossPlan(ChunkedLoss(4096)).peak_bytes(t, h, v, True) == FullLossPlan(FullLoss()).peak_bytes(
        t, h, v, True
    ) + 2 * (v * h + t * h)


def test_chunked_runs_the_heads_gemms_once_and_sums_the_weight_gradient():
    """No GEMM runs twice (dense_gemm as full's); ``other`` adds the fp32 sum's traffic per chunk and its one cast."""
    from moe_lab.plan.models.loss import CHUNK_SUM_BYTES_PER_PARAM, SUM_CAST_BYTES_PER_PARAM
    from moe_lab.plan.step_time import plan_time

    (full, hw), (chunked, _) = planned_step("loss=full"), planned_step("loss=chunked")
    full_s, chunked_s = plan_time(full, hw)["seconds"], plan_time(chunked, hw)["seconds"]
    assert chunked_s["dense_gemm"] == full_s["dense_gemm"]
    head = full.cfg.vocab_size * full.cfg.hidden_size
    added = head * (16384 // 4096 * CHUNK_SUM_BYTES_PER_PARAM + SUM_CAST_BYTES_PER_PARAM) / hw.hbm_bytes_per_s
    assert chunked_s["other"] - full_s["other"] == pytest.approx(added, rel=1e-9)


def test_a_record_made_before_the_loss_group_is_planned_with_full_logits():
    from moe_lab.plan.records import plan_record, read
    from tests.sweep import ROOT

    record = read(ROOT / "experiments/full_depth/records/h200_1gpu_seq16384/2026-12-02_05-46/save-gate_up/result.json")
    assert plan_record(record)["plan"]["memory"]["by_category_gib"]["loss"] == pytest.approx(4 * 16384 * 151936 / 2**30)


# --- CUDA -----------------------------------------------------------------------------------------------------------
GPU_SHAPE = {"tokens": 16384, "hidden": 2048, "vocab": 151936}  # Qwen3-30B-A3B's head at seq 16384


def gpu_run(loss_fn, hidden, weight, labels):
    """Loss, gradients, and the peak bytes allocated beyond the inputs over forward and backward."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = loss_fn(hidden, weight, labels)
    grads = torch.autograd.grad(loss, (hidden, weight))
    torch.cuda.synchronize()
    return [loss.detach(), *grads], torch.cuda.max_memory_allocated() - before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_chunked_on_cuda_in_bf16_matches_full_and_holds_a_chunk(compiled):
    """Qwen3-30B-A3B's head at 16,384 tokens in bf16 (FSDP2's parameters): chunked gives full's loss and gradients
    within bf16 rounding at a fraction of its peak; compiled (as the studies run), each peak is its planner model's
    (moe_lab.plan.models.loss) within 10 %."""
    from moe_lab.parallel import compile_loss
    from moe_lab.plan.models.loss import ChunkedLossPlan, FullLossPlan

    t, h, v = GPU_SHAPE["tokens"], GPU_SHAPE["hidden"], GPU_SHAPE["vocab"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(1, t, h, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.02 * torch.randn(v, h, device="cuda", generator=gen)).bfloat16().requires_grad_()
    labels = torch.randint(0, v, (1, t), device="cuda", generator=gen)
    chunked, full = ChunkedLoss(4096), FullLoss()
    if compiled:
        chunked, full = compile_loss(chunked), compile_loss(full)
        gpu_run(chunked, hidden, weight, labels), gpu_run(full, hidden, weight, labels)  # compile outside the peak
    expected, full_peak = gpu_run(full, hidden, weight, labels)
    got, chunked_peak = gpu_run(chunked, hidden, weight, labels)
    torch.testing.assert_close(got[0], expected[0], rtol=1e-3, atol=1e-4)
    assert got[1].dtype == got[2].dtype == torch.bfloat16
    for name, g, e in zip(("d hidden", "d weight"), got[1:], expected[1:]):
        assert relative(g, e) < 4 * 2**-8, name
    planned = {
        "chunked": ChunkedLossPlan(ChunkedLoss(4096)).peak_bytes(t, h, v, compiled),
        "full": FullLossPlan(FullLoss()).peak_bytes(t, h, v, compiled),
    }
    print(
        f"peak beyond the inputs: chunked {chunked_peak / 2**30:.2f} GiB, full {full_peak / 2**30:.2f} GiB; planned "
        f"{planned['chunked'] / 2**30:.2f}, {planned['full'] / 2**30:.2f}"
    )
    assert chunked_peak < full_peak / 2
    if compiled:
        assert chunked_peak == pytest.approx(planned["chunked"], rel=0.1)
        assert full_peak == pytest.approx(planned["full"], rel=0.1)
