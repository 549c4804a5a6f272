"""The planner's figures that its record-fitted tests leave loose, each held to what its docstring says it counts
(hand-computed from the model's shapes, the hardware profile's published figures, or a second way of reaching the
same figure): the fit's terms, the searches' edges, the memory and time terms a record's tolerance hides, the
hardware profile's rates, the records' overrides and calibrate's shares. No model is built and no GPU is used."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from moe_lab.config import ConfigError
from moe_lab.plan.config import compose
from moe_lab.plan.hardware import Hardware
from moe_lab.plan.memory import (
    GIB,
    backward_workspace,
    fused_saved_per_layer,
    plan_memory,
    resident_layers,
    saved_per_layer,
)
from moe_lab.plan.planner import (
    ALLOCATOR_RESERVE,
    ALLOCATOR_RESERVE_EDGE,
    build_hardware,
    fastest_fitting,
    fits,
    largest,
    plan,
    step_of,
    usable_device_bytes,
    validated,
)
from moe_lab.plan.step_time import attention_seq_factor, exchange_bytes, exchange_seconds, fsdp_bytes, plan_time
from moe_lab.runtime.paths import CONF_DIR

QWEN_2L = ["model=qwen3_30b", "model.num_layers=2"]


def planned(*overrides):
    """The step, hardware and training config of a plan of ``overrides``."""
    cfg = compose(list(overrides))
    hw = build_hardware(cfg.hardware, cfg.trainer.nproc_per_node)
    train, options = validated(cfg, hw)
    return step_of(train, options, hw), hw, train


def dense_layer(c) -> int:
    """A decoder layer's parameters that are not experts: q/k/v/o, q/k norms, two layer norms, the router."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return c.hidden_size * (2 * q + 2 * kv) + 2 * c.head_dim + 2 * c.hidden_size + c.num_experts * c.hidden_size


def expert_layer(c) -> int:
    """A decoder layer's experts: gate, up and down [I, H] each."""
    return c.num_experts * 3 * c.hidden_size * c.moe_intermediate_size


def layer_params(c, ep: int = 1) -> int:
    """One decoder layer as FSDP gathers it on a rank: its dense weights and its EP share of the experts."""
    return dense_layer(c) + expert_layer(c) // ep


def seconds_of(step, hw) -> dict:
    return plan_time(step, hw)["seconds"]


# --- the fit and the searches -----------------------------------------------------------------------------------


def test_memory_outside_the_allocator_counts_towards_the_fit():
    """The fused op's symmetric workspace at EP > 1 (4 receive-side buffers on the 1.25x ladder, and two bf16
    [T, H] buffers) is not in the allocator's peak but takes device memory: a GPU that holds the reserved peak but
    not the workspace beside it does not fit the step."""
    step, hw, _ = planned(*QWEN_2L, "dispatcher=fused", "parallel.ep=2", "hardware.gpus_per_node=2",
                          "data.seq_len=4096", "data.batch_size=1")  # fmt: skip
    c, t = step.cfg, 4096
    rows = t * c.num_experts_per_tok  # balanced: a rank receives the slots it routes; 512 a local expert, aligned
    workspace = rows * 1.25 * (8 + 4 + 4 + 2 * c.hidden_size) + 2 * 2 * t * c.hidden_size
    memory = plan_memory(step)
    assert memory.outside_allocator == {"fused symmetric workspace": pytest.approx(workspace, rel=1e-12)}
    reserved = ALLOCATOR_RESERVE * memory.peak
    short = dataclasses.replace(hw, hbm_gib=(reserved + workspace / 2) / GIB + hw.context_gib)
    ok, why = fits(step, short)
    assert not ok and why.startswith("device:")
    roomy = dataclasses.replace(hw, hbm_gib=ALLOCATOR_RESERVE_EDGE * (memory.peak + workspace) / GIB + hw.context_gib)
    assert fits(step, roomy) == (True, "fits")


def test_largest_is_none_where_even_the_smallest_does_not_fit():
    """The depth and sequence searches say None, not their lower bound, where that bound does not fit: here a GPU
    of 2 GiB, which the 30B proxy's weights alone outgrow."""
    step, hw, _ = planned(*QWEN_2L)
    small = dataclasses.replace(hw, hbm_gib=2.0)
    assert largest(step, small, "num_layers", 1, 8) is None
    assert largest(step, small, "seq_len", 128, 1024, multiple=128) is None
    assert largest(step, hw, "num_layers", 1, 8) == 8  # the same searches on the H200


def test_tokens_per_step_count_every_micro_batch():
    """With gradient accumulation a step trains ``grad_accum`` micro-batches: tokens per step and per second, in the
    plan's metrics and in the fastest setting it finds, count them all."""
    cfg = compose(["data.seq_len=256", "data.batch_size=2", "trainer.grad_accum=4"])
    planned_ = plan(cfg)
    metrics, fastest = planned_["metrics"], planned_["plan"]["fastest_fitting"]
    tokens = 256 * 2 * 4
    assert metrics["tokens_per_step_per_gpu"] == tokens
    assert metrics["tokens_per_s_per_gpu"] == pytest.approx(tokens / metrics["s_per_step"], rel=1e-12)
    assert fastest["tokens_per_s_per_gpu"] == pytest.approx(tokens / fastest["s_per_step"], rel=1e-12)


def test_the_allocator_slack_is_what_reserving_adds_to_the_peak():
    """``allocator_slack_gib``: the reserved memory beyond the allocated peak (nothing outside the allocator on one
    GPU with the torch dispatcher): reserved = peak + slack."""
    memory = plan(compose(QWEN_2L), search=False)["plan"]["memory"]
    assert memory["outside_allocator_gib"] == {}
    assert memory["reserved_gib"] == pytest.approx(memory["peak_gib"] + memory["allocator_slack_gib"], rel=1e-12)
    assert memory["allocator_slack_gib"] == pytest.approx((ALLOCATOR_RESERVE - 1) * memory["peak_gib"], rel=1e-12)


def test_host_rss_is_the_training_process_and_what_offload_keeps_there():
    """``peak_host_rss_gib``: a training process's own 1.5 GiB (the records' offload=none RSS), and the host
    memory its offload mode keeps beside it."""
    none = plan(compose(QWEN_2L), search=False)
    assert none["plan"]["memory"]["host_gib"] == {}
    assert none["metrics"]["peak_host_rss_gib"] == pytest.approx(1.5)
    moved = plan(compose([*QWEN_2L, "offload=optimizer"]), search=False)
    host = moved["plan"]["memory"]["host_total_gib"]
    assert host > 1 and moved["metrics"]["peak_host_rss_gib"] == pytest.approx(1.5 + host, rel=1e-12)


def test_an_fp32_run_is_refused_naming_the_key():
    with pytest.raises(ConfigError) as error:
        plan(compose(["trainer.precision=fp32"]), search=False)
    assert error.value.key == "trainer.precision"


def test_the_configured_offload_mode_is_searched_with_its_own_values():
    """The depth search under the offload mode the config names uses the config's values of it, not the mode's
    defaults: offload=optimizer with a ring of every chunk keeps all the optimizer state on the GPU, as
    offload=none does, and fits no deeper than it."""
    cfg = compose(["model=qwen3_30b", "offload=optimizer", "offload.max_inflight=100000"])
    deepest = plan(cfg)["plan"]["largest_fitting"]
    assert deepest["optimizer"]["num_layers"] == deepest["none"]["num_layers"]
    default = plan(compose(["model=qwen3_30b", "offload=optimizer"]))["plan"]["largest_fitting"]
    assert default["optimizer"]["num_layers"] > deepest["optimizer"]["num_layers"]


def test_the_fastest_setting_says_whether_it_is_at_the_edge():
    """The fastest setting's ``at_edge``: its reserved peak fits, but not at the largest reserve the records show
    (full depth at seq 16384 keeping everything: about 127 GiB of 139.8)."""
    step, hw, train = planned("+experiment=full_depth", "hardware=h200", "hardware.gpus_per_node=1")
    fastest = fastest_fitting(step, hw, train)
    peak = fastest["peak_gpu_mem_gib"] * GIB
    assert ALLOCATOR_RESERVE * peak <= usable_device_bytes(hw) < ALLOCATOR_RESERVE_EDGE * peak
    assert fastest["at_edge"] is True


# --- memory ------------------------------------------------------------------------------------------------------


def test_ac_none_keeps_the_elementwise_outputs_beyond_selective():
    """Without AC a block keeps, beyond what selective AC keeping every set keeps, the elementwise outputs backward
    reads: the two norms' outputs, q/k after their norms and RoPE (bf16), the residual stream's add (fp32 on one
    GPU), and the torch dispatcher's gathered rows and SwiGLU input (bf16, per routed row)."""
    none, _, _ = planned(*QWEN_2L, "ac=none")
    selective, _, _ = planned(*QWEN_2L, "ac=selective")
    c, t = none.cfg, none.tokens
    q, kv, rows = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, t * c.num_experts_per_tok
    elementwise = 2 * t * (2 * c.hidden_size + q + kv) + 4 * t * c.hidden_size
    elementwise += rows * 2 * (c.hidden_size + c.moe_intermediate_size)
    assert saved_per_layer(none) - saved_per_layer(selective) == pytest.approx(elementwise, rel=1e-12)


def test_keeping_attention_keeps_its_output_and_logsumexp():
    """ac.keep's attention set keeps flash attention's output (bf16 [T, heads x head_dim]) and its logsumexp (fp32
    per token and head)."""
    kept, _, _ = planned(*QWEN_2L, "ac=selective")
    dropped, _, _ = planned(*QWEN_2L, "ac=selective", "ac.keep=[matmul,grouped_mm,router,dispatcher]")
    c, t = kept.cfg, kept.tokens
    attention = 2 * t * c.num_heads * c.head_dim + 4 * t * c.num_heads
    assert saved_per_layer(kept) - saved_per_layer(dropped) == pytest.approx(attention, rel=1e-12)


def test_backward_workspace_holds_the_experts_gradients_and_the_bf16_weight_gradients():
    """One block's backward beyond what it saved, on one GPU with the torch dispatcher: per routed row the experts'
    activation gradients (bf16: 2H of input and output, 2I of gate/up and I of the SwiGLU), and the layer's weight
    gradients in bf16 before they are widened into fp32 .grad; full AC adds the block's forward again, which is
    what the block keeps without AC."""
    none, _, _ = planned(*QWEN_2L, "ac=none")
    full, _, _ = planned(*QWEN_2L, "ac=full")
    c = none.cfg
    rows = none.tokens * c.num_experts_per_tok
    expected = rows * 2 * (2 * c.hidden_size + 3 * c.moe_intermediate_size) + 2 * layer_params(c)
    assert backward_workspace(none) == pytest.approx(expected, rel=1e-12)
    assert backward_workspace(full) - backward_workspace(none) == pytest.approx(saved_per_layer(none), rel=1e-12)


def test_backward_of_the_last_layer_holds_its_gradients_and_workspace():
    """From the loss to the last layer's backward (one GPU, loss=full, no offload): the loss's logits and their
    gradient go (4 bytes a logit compiled), the LM head's and the last layer's fp32 gradients come (its own
    included: they exist while its workspace does), and the layer's backward workspace."""
    step, _, _ = planned(*QWEN_2L, "loss=full", "trainer.compile=true")
    c, t = step.cfg, step.tokens
    phases = plan_memory(step).phases
    rows = t * c.num_experts_per_tok
    workspace = rows * 2 * (2 * c.hidden_size + 3 * c.moe_intermediate_size) + 2 * layer_params(c)
    grads = 4 * (c.vocab_size * c.hidden_size + layer_params(c))
    expected = grads + workspace - 4 * t * c.vocab_size
    assert (phases["backward layer 1"] - phases["loss"]) * GIB == pytest.approx(expected, rel=1e-9)


def test_offloaded_activations_resident_on_the_device():
    """With ac.offload_activations at full pace only the last layer's saved tensors are on the device at the loss,
    a layer's own and the one before it (prefetched) in backward, the first layer's alone at its backward; at no
    pace every layer's stay."""
    step, _, _ = planned("+experiment=full_depth", "ac.offload_activations=true")
    layers = step.cfg.num_layers
    assert resident_layers(step, None, 1.0) == 1
    assert resident_layers(step, layers - 1, 1.0) == 2
    assert resident_layers(step, 0, 1.0) == resident_layers(step, 0, 0.0) == 1
    assert resident_layers(step, None, 0.0) == layers


def grads_at_loss(*overrides) -> float:
    """The loss phase's bytes with 2 micro-batches less those with 1: the gradients held from the earlier one."""
    one, two = (plan_memory(planned(*overrides, f"trainer.grad_accum={a}")[0]).phases["loss"] for a in (1, 2))
    return (two - one) * GIB


def test_gradient_accumulation_holds_what_each_mode_accumulates_in():
    """The last micro-batch's loss holds the earlier ones' gradients: under FSDP2 with grad_sync=step the fp32
    unsharded accumulators of the EP-local model, with grad_sync=micro_batch the fp32 sharded .grad; on one GPU fp32
    .grad (offload=none) or offload=full's bf16 .grad, in place of its gradients in flight to the host."""
    mesh = ["hardware.gpus_per_node=4", "parallel.ep=2"]
    step, _, _ = planned(*QWEN_2L, *mesh)
    c = step.cfg
    outside = 2 * c.vocab_size * c.hidden_size + c.hidden_size
    total = step.shapes.total_params
    unsharded = outside + c.num_layers * layer_params(c, ep=2)
    assert grads_at_loss(*QWEN_2L, *mesh) == pytest.approx(4 * unsharded, rel=1e-9)
    assert grads_at_loss(*QWEN_2L, *mesh, "parallel.grad_sync=micro_batch") == pytest.approx(4 * total / 4, rel=1e-9)
    assert grads_at_loss(*QWEN_2L) == pytest.approx(4 * total, rel=1e-9)
    full, _, _ = planned(*QWEN_2L, "offload=full")
    in_flight = full.offload.device_state(full, total)[3]
    assert in_flight > 0
    assert grads_at_loss(*QWEN_2L, "offload=full") == pytest.approx(2 * total - in_flight, rel=1e-9)


def test_fsdp_buffers_without_resharding_hold_every_block():
    """parallel.reshard_after_forward=false: every block's bf16 weights (and the embedding, head and final norm)
    stay gathered from forward into backward, beside a block's unsharded gradients (bf16, then fp32)."""
    step, _, _ = planned(*QWEN_2L, "hardware.gpus_per_node=4", "parallel.ep=2", "parallel.reshard_after_forward=false")
    c = step.cfg
    block = layer_params(c, ep=2)
    outside = 2 * c.vocab_size * c.hidden_size + c.hidden_size
    memory = plan_memory(step)
    assert memory.categories["comm buffers (FSDP2)"] == pytest.approx(
        2 * (outside + c.num_layers * block) + 6 * block, rel=1e-12
    )


def test_fsdp_buffers_in_backward_hold_the_blocks_gradients():
    """In backward FSDP2 holds the gathered bf16 block and the next (prefetched), the LM head kept gathered, and the
    block's unsharded gradients, bf16 then fp32 for the reduce-scatter."""
    step, _, _ = planned(*QWEN_2L, "hardware.gpus_per_node=4", "parallel.ep=2")
    memory = plan_memory(step)
    assert memory.phase.startswith("backward")
    c = step.cfg
    block = layer_params(c, ep=2)
    assert memory.categories["comm buffers (FSDP2)"] == pytest.approx(
        2 * 2 * block + (2 + 4) * block + 2 * c.vocab_size * c.hidden_size, rel=1e-12
    )


@pytest.mark.parametrize("loss, head", [("full", True), ("chunked", False)])
def test_backward_keeps_the_heads_bf16_copy_only_where_the_loss_saved_it(loss, head):
    """One GPU: autocast's bf16 copy of the current block in backward, and of the LM head only under loss=full
    (loss=chunked made the head's gradients in forward)."""
    step, _, _ = planned(*QWEN_2L, f"loss={loss}")
    memory = plan_memory(step)
    assert memory.phase.startswith("backward")
    c = step.cfg
    expected = 2 * layer_params(c) + (2 * c.vocab_size * c.hidden_size if head else 0)
    assert memory.categories["bf16 params"] == pytest.approx(expected, rel=1e-12)


def test_uncompiled_full_loss_holds_the_logits_in_fp32_too():
    """loss=full uncompiled holds, beside the bf16 logits, their fp32 upcast, the log-softmax and its gradient in
    fp32: 14 bytes a logit at the loss, where compiled it holds the bf16 logits and their bf16 gradient (4)."""
    eager, _, _ = planned(*QWEN_2L, "loss=full", "trainer.compile=false")
    compiled, _, _ = planned(*QWEN_2L, "loss=full", "trainer.compile=true")
    logits = eager.tokens * eager.cfg.vocab_size
    eager_loss, compiled_loss = (plan_memory(s).phases["loss"] * GIB for s in (eager, compiled))
    assert eager_loss - compiled_loss == pytest.approx((2 + 4 + 4 + 4 - 4) * logits, rel=1e-9)


def test_offload_full_optimizer_step_holds_the_gradients_in_flight():
    """offload=full with every chunk stepped on the host: at its optimizer step the GPU holds the bf16 weights and
    the last chunk's bf16 gradients in flight (the largest chunk's worth)."""
    step, _, _ = planned(*QWEN_2L, "offload=full")
    n = step.shapes.total_params
    chunks = step.offload.chunks(step, reverse=True)
    assert plan_memory(step).phases["optimizer step"] * GIB == pytest.approx(2 * n + 2 * max(chunks), rel=1e-12)


# --- step time ---------------------------------------------------------------------------------------------------


def test_attention_rate_at_the_published_short_sequence_and_capped_at_long_ones():
    """Flash attention at seq 4096 took 1.25x what the profile's rate gives (step_time's note); at and beyond the
    reference sequence it runs at the profile's rate, never faster."""
    assert 1 / attention_seq_factor(4096) == pytest.approx(1.25, rel=0.01)
    assert attention_seq_factor(16384) == pytest.approx(1.0)
    assert attention_seq_factor(32768) == attention_seq_factor(131072) == 1.0


def test_ep_across_nodes_sends_to_the_remote_peers_over_the_nics():
    """EP 16 on 2 nodes of 8 (the torch dispatcher): 7 of a rank's 15 peers share its node (NVLink), 8 are on the
    other (its NIC); both go at once and the slower share sets the exchange's time."""
    step, hw, _ = planned("model=qwen3_30b", "model.num_layers=2", "hardware.nodes=2", "hardware.gpus_per_node=8",
                          "parallel.ep=16")  # fmt: skip
    assert step.mesh.ep_across_nodes and not step.mesh.expert_shard_across_nodes
    sent = exchange_bytes(step)
    nvlink = 7 / 15 * sent / (hw.nvlink_gbps * 1e9 * hw.nvlink_efficiency)
    nic = 8 / 15 * sent / (hw.internode_gbps * 1e9 * hw.internode_efficiency)
    assert exchange_seconds(step, hw) == pytest.approx(max(nvlink, nic), rel=1e-12)


def test_mesh_crosses_nodes_only_where_its_groups_are_wider_than_a_node():
    """EP groups are consecutive ranks (across nodes only when wider than a node); the ranks sharding the same
    experts sit ``ep`` apart in a replica (across nodes when the replica spans nodes and more than one rank shards
    them)."""
    from moe_lab.plan.shapes import Mesh

    assert not Mesh(world=16, gpus_per_node=8, ep=8).ep_across_nodes
    assert Mesh(world=16, gpus_per_node=8, ep=16).ep_across_nodes
    assert Mesh(world=16, gpus_per_node=8, ep=8).expert_shard_across_nodes  # the 2 ranks sharding them: 8 apart
    assert not Mesh(world=16, gpus_per_node=8, ep=16).expert_shard_across_nodes  # nothing shards the experts
    assert not Mesh(world=16, gpus_per_node=8, ep=4, dp_replicate=2).expert_shard_across_nodes  # a replica a node


def test_fsdp_gathers_once_a_step_without_resharding():
    """parallel.reshard_after_forward=false with 4 micro-batches: the blocks stay gathered until the step's last
    backward, so a step gathers each weight once (with resharding: forward and backward of every micro-batch),
    and FSDP2's copy-out on the compute stream follows the gathers (6 bytes per unsharded parameter each)."""
    common = [*QWEN_2L, "hardware.gpus_per_node=8", "parallel.ep=2", "trainer.grad_accum=4"]
    kept, hw, _ = planned(*common, "parallel.reshard_after_forward=false")
    resharded, _, _ = planned(*common)
    c = kept.cfg
    dense = 2 * c.vocab_size * c.hidden_size + c.hidden_size + c.num_layers * dense_layer(c)
    experts = c.num_layers * expert_layer(c) / 2
    assert fsdp_bytes(kept)["dense all_gather"][0] == pytest.approx(2 * dense * 7 / 8, rel=1e-9)
    assert fsdp_bytes(resharded)["dense all_gather"][0] == pytest.approx(8 * 2 * dense * 7 / 8, rel=1e-9)
    # the experts gather over the 4 ranks that shard them (EP 2 of 8), not the replica's 8
    assert fsdp_bytes(kept)["expert all_gather"][0] == pytest.approx(2 * experts * 3 / 4, rel=1e-9)
    timed = plan_time(kept, hw)
    casts = timed["seconds"]["fsdp_all_gather"] - timed["exposed_communication_s"]["fsdp_all_gather"]
    unsharded = 2 * c.vocab_size * c.hidden_size + c.hidden_size + c.num_layers * layer_params(c, ep=2)
    assert casts == pytest.approx(6 * unsharded / hw.hbm_bytes_per_s, rel=1e-9)


def test_uncompiled_elementwise_work_is_three_times_the_compiled():
    """trainer.compile=false runs the norms, RoPE and residual adds unfused: ``other``'s elementwise traffic (20 kB
    per token, layer and pass, three passes without AC) three times over; nothing else in it changes."""
    eager, hw, _ = planned(*QWEN_2L, "trainer.compile=false")
    compiled, _, _ = planned(*QWEN_2L, "trainer.compile=true")
    added = (3 - 1) * eager.cfg.num_layers * 3 * eager.tokens * 20_000 / hw.hbm_bytes_per_s
    assert seconds_of(eager, hw)["other"] - seconds_of(compiled, hw)["other"] == pytest.approx(added, rel=1e-9)


def test_full_ac_recomputes_the_blocks_dense_gemms_not_the_heads():
    """ac=full runs each block's forward again (its attention projections and router: one more pass of
    ``layer_dense_flops``); the LM head's GEMMs stay three passes."""
    none, hw, _ = planned(*QWEN_2L, "ac=none")
    full, _, _ = planned(*QWEN_2L, "ac=full")
    c, t = none.cfg, none.tokens
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layer_dense = c.num_layers * 2 * (c.hidden_size * (2 * q + 2 * kv) + 2 * c.head_dim + c.num_experts * c.hidden_size)
    recomputed = layer_dense * t / hw.flops("dense_gemm")
    assert seconds_of(full, hw)["dense_gemm"] - seconds_of(none, hw)["dense_gemm"] == pytest.approx(
        recomputed, rel=1e-9
    )


def slow_offload(*overrides):
    step, hw, _ = planned("+experiment=full_depth", "ac.offload_activations=true", *overrides)
    return step, dataclasses.replace(hw, pcie_gbps=4.0)  # slow enough that forward's copies fall behind


def test_activation_offload_pace_is_per_micro_batch():
    """The share of forward's saved bytes PCIe takes while forward runs (a third of a micro-batch's compute) is a
    micro-batch's: the same at 1 and at 2 micro-batches of the same shape; what outlasts each micro-batch's compute
    is exposed once per micro-batch."""
    from moe_lab.plan.memory import offloaded_bytes
    from moe_lab.plan.step_time import offload_pace

    one, hw = slow_offload()
    two, _ = slow_offload("trainer.grad_accum=2")
    seconds = seconds_of(one, hw)
    compute = sum(seconds[k] for k in ("dense_gemm", "expert_gemm", "attention", "dispatch_glue", "other"))
    copy_out = offloaded_bytes(one) / hw.pcie_bytes_per_s
    assert 0 < offload_pace(one, hw) < 1
    assert offload_pace(one, hw) == pytest.approx(compute / 3 / copy_out, rel=1e-9)
    assert offload_pace(two, hw) == pytest.approx(offload_pace(one, hw), rel=1e-9)
    assert seconds_of(two, hw)["pcie"] == pytest.approx(2 * seconds["pcie"], rel=1e-9)


def test_the_first_block_hides_no_gather():
    """A block's gather overlaps the neighbouring block's compute: of a step's compute split over its blocks,
    embedding and head, all but the first group's hides gathers; the first gather is exposed whole."""
    from moe_lab.plan.step_time import fsdp_exposed

    step, hw, _ = planned("+experiment=reference_30b", "hardware.nodes=2", "hardware.gpus_per_node=8", "ac=full")
    groups = step.cfg.num_layers + 2
    _, total = fsdp_exposed(step, hw, compute=0.0)
    gather = total["fsdp_all_gather"]
    first = fsdp_exposed(step, hw, compute=1e6)[0]["fsdp_all_gather"]
    compute = 0.5 * gather
    exposed, _ = fsdp_exposed(step, hw, compute=compute)
    assert exposed["fsdp_all_gather"] == pytest.approx(gather - compute * (groups - 1) / groups + first, rel=1e-9)


def test_offload_optimizer_exposes_the_moments_backward_does_not_cover():
    """offload=optimizer: the state beyond its ring comes in during the last micro-batch's backward (two thirds of
    a micro-batch's compute); what takes longer shows in ``pcie``."""
    step, hw, _ = planned(*QWEN_2L, "offload=optimizer")
    slow = dataclasses.replace(hw, pcie_gbps=2.0)
    seconds = seconds_of(step, slow)
    compute = sum(seconds[k] for k in ("dense_gemm", "expert_gemm", "attention", "dispatch_glue", "other"))
    n = step.shapes.total_params
    moved = 8 * (n - step.offload.ring_params(step)) / slow.pcie_bytes_per_s
    assert seconds["pcie"] == pytest.approx(moved - compute * 2 / 3, rel=1e-9) and seconds["pcie"] > 0


def test_foreach_adamw_streams_more_and_allocates_its_square_roots():
    """optimizer.fused=false: torch's foreach AdamW, 60 bytes of HBM traffic per parameter (fused: 28), and the
    square root of every exp_avg_sq at once (fp32) at its step."""
    fused, hw, _ = planned(*QWEN_2L, "optimizer.fused=true")
    foreach, _, _ = planned(*QWEN_2L, "optimizer.fused=false")
    n = fused.shapes.total_params
    assert seconds_of(fused, hw)["optimizer"] == pytest.approx(28 * n / hw.hbm_bytes_per_s, rel=1e-12)
    assert seconds_of(foreach, hw)["optimizer"] == pytest.approx(60 * n / hw.hbm_bytes_per_s, rel=1e-12)
    phases = (plan_memory(foreach).phases, plan_memory(fused).phases)
    assert (phases[0]["optimizer step"] - phases[1]["optimizer step"]) * GIB == pytest.approx(4 * n, rel=1e-9)


# --- the fused dispatcher's buffers ------------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [1100, 33])  # 68.75 and 2.0625 rows an expert
def test_fused_receive_rows_pad_each_expert_segment(seq_len):
    """Each local expert's segment is padded to the GEMM's alignment: by half a block on average where the rows
    per expert are not whole, and to one block at least."""
    step, _, _ = planned("model=qwen3_30b", "model.num_layers=1", "dispatcher=fused", f"data.seq_len={seq_len}",
                         "data.batch_size=1")  # fmt: skip
    c, align = step.cfg, step.dispatcher.align(step)
    per_expert = seq_len * c.num_experts_per_tok / c.num_experts
    assert per_expert != int(per_expert)
    expected = c.num_experts * max(per_expert + align / 2, align)
    assert step.dispatcher.receive_rows(step) == pytest.approx(expected, rel=1e-12)


def test_fused_save_inputs_keeps_each_rows_weight_source_and_slot():
    """dispatcher.save=inputs keeps no row of its own (compiled, nor the op's output): per received row its fp32
    weight and int64 source, and per routed slot its int64 position."""
    step, _, _ = planned("+experiment=full_depth", "dispatcher.save=inputs")
    rows, slots = step.dispatcher.receive_rows(step), step.tokens * step.cfg.num_experts_per_tok
    assert fused_saved_per_layer(step) == pytest.approx(rows * (4 + 8) + 8 * slots, rel=1e-12)


# --- the hardware profile ----------------------------------------------------------------------------------------


def h200() -> Hardware:
    values = yaml.safe_load((CONF_DIR / "hardware" / "h200.yaml").read_text())
    values.pop("_target_")
    return Hardware(**values).on_mesh(1)


def test_h200_rates_are_its_datasheet_peaks_at_the_fitted_shares():
    """The H200 profile's rates: its datasheet peaks (989 bf16 TFLOP/s, 4.8 TB/s HBM, 450 GB/s NVLink, 64 GB/s
    PCIe) times the shares fitted on its records."""
    hw = h200()
    assert hw.flops("dense_gemm") == pytest.approx(989e12 * 0.77)
    assert hw.flops("fp8_grouped_gemm") == pytest.approx(1979e12 * 0.66)
    assert hw.hbm_bytes_per_s == pytest.approx(4.8e12 * 0.73)
    assert hw.link_bytes_per_s(False) == pytest.approx(450e9 * 0.70)
    assert hw.link_bytes_per_s(True) == pytest.approx(50e9 * 0.80)
    assert hw.pcie_bytes_per_s == pytest.approx(64e9 * 0.83)


def test_host_adamw_shares_the_nodes_bandwidth_among_its_ranks():
    """offload=full's host step: 32 bytes a parameter at the host's AdamW share of the node's bandwidth, which the
    node's ranks share; on 8 GPUs of a node each rank's host step takes 8 times one rank's alone."""
    hw = h200()
    assert hw.host_adamw_params_per_s(1) == pytest.approx(318e9 * 0.75 / 32)
    assert hw.host_adamw_params_per_s(8) == pytest.approx(hw.host_adamw_params_per_s(1) / 8)
    one, hw1, _ = planned(*QWEN_2L, "offload=full", "hardware.gpus_per_node=1")
    eight, hw8, _ = planned(*QWEN_2L, "offload=full", "hardware.gpus_per_node=8")
    on_host = sum(eight.offload.split_chunks(eight)[0])
    assert seconds_of(eight, hw8)["host_step"] == pytest.approx(8 * on_host / hw1.host_adamw_params_per_s(1))


def test_an_efficiency_above_one_is_refused_naming_its_key():
    """An achieved share is in (0, 1]: more than the datasheet's peak is a typo, refused by its key."""
    with pytest.raises(ConfigError) as error:
        build_hardware(compose(["++hardware.dense_gemm_efficiency=1.5"]).hardware)
    assert error.value.key == "hardware.dense_gemm_efficiency"


def test_a_profile_file_plan_records_its_path(tmp_path):
    """``hardware=file``: the plan's hardware names the profile file it read, beside its values."""
    profile = tmp_path / "profile.yaml"
    values = yaml.safe_load((CONF_DIR / "hardware" / "h200.yaml").read_text())
    for key in ("_target_", "nodes", "gpus_per_node"):
        values.pop(key)
    profile.write_text(yaml.safe_dump(values))
    planned_ = plan(compose(["hardware=file", f"hardware.path={profile}"]), search=False)
    assert planned_["plan"]["hardware"]["path"] == str(profile)
    assert planned_["plan"]["hardware"]["name"] == "h200"


# --- records, emulated points, calibrate -------------------------------------------------------------------------


def test_a_record_naming_no_commit_is_planned_as_the_oldest_code_ran():
    """A record without ``environment.git_commit`` is taken to be older than every change: all logits at once,
    foreach AdamW, and for the torch dispatcher permutations by index_select (only for it: the key is its own)."""
    from moe_lab.plan.records import as_made, made_before

    record = {"environment": {}}
    assert made_before(record, "0661658")
    assert as_made(record) == ["loss=full", "optimizer.fused=false"]
    assert as_made(record, "torch") == ["loss=full", "optimizer.fused=false", "dispatcher.permute=select"]
    assert as_made(record, "fused") == ["loss=full", "optimizer.fused=false"]


def test_an_emulated_points_compute_is_its_plan_less_the_exposed_wire():
    """An emulated rank's record: the plan's compute is its step less the exposed communication it adds for the
    wire, and the emulated total is the measured step plus that wire."""
    from moe_lab.plan.emulated import emulated_metrics
    from tests.configs import compose_train

    cfg = compose_train(*QWEN_2L, "trainer.nproc_per_node=2", "parallel.ep=2", "parallel.emulate=true",
                        "parallel.emulate_nodes=1", "trainer.compile=true")  # fmt: skip
    out = emulated_metrics(cfg, {"s_per_step": 1.0, "tokens_per_step_per_gpu": 4096})
    wire = out["planned_exposed_comm_s"]
    assert wire > 0
    assert out["planned_compute_s"] == pytest.approx(out["planned_s_per_step"] - wire, rel=1e-12)
    assert out["s_per_step_emulated_total"] == pytest.approx(1.0 + wire, rel=1e-12)


def test_calibrate_counts_attention_flops_as_the_planner_does(monkeypatch):
    """calibrate's attention rate is over the FLOPs the planner counts (forward 2 x seq x heads x head_dim per
    token, backward 2.5 times that), so that its share is the planner's."""
    from moe_lab.models.qwen3_moe import Qwen3MoeConfig
    from moe_lab.plan import calibrate
    from moe_lab.plan.shapes import Shapes
    from moe_lab.plan.step_time import ATTENTION_BACKWARD

    s = calibrate.SIZES["tiny"]
    monkeypatch.setattr(calibrate, "timed", lambda fn, device, repeats=5: 1.0)
    counted = Qwen3MoeConfig.preset("tiny", num_layers=1, num_heads=s["heads"], head_dim=s["head_dim"])
    flops = Shapes(counted).attention_flops(s["seq"], s["seq"]) * (1 + ATTENTION_BACKWARD)
    assert calibrate.attention_flops(torch.device("cpu"), torch.float32, s) == pytest.approx(flops, rel=1e-12)


def test_calibrate_shares_are_the_measured_rates_over_the_peaks(monkeypatch):
    """calibrate's ``*_efficiency``: a measured rate over its base profile's peak, rounded, at most 1 (a rate above
    the datasheet's is a measurement off, not a faster GPU); HBM's over the bytes a copy reads and writes; the host
    step's over the host's own bandwidth."""
    from moe_lab.plan import calibrate

    monkeypatch.setattr(torch, "set_num_threads", lambda threads: None)  # the host step's threads: this process's
    monkeypatch.setattr(calibrate, "gemm_flops", lambda *a: 2 * 989e12)  # twice the H200's peak
    monkeypatch.setattr(calibrate, "grouped_gemm_flops", lambda *a: 0.5 * 989e12)
    monkeypatch.setattr(calibrate, "attention_flops", lambda *a: 0.123456789 * 989e12)
    monkeypatch.setattr(calibrate, "copy_bytes_per_s", lambda *a: 0.25 * 4.8e12)
    monkeypatch.setattr(calibrate, "host_adamw_params_per_s", lambda s: 1e9)  # 32 GB/s
    monkeypatch.setattr(calibrate, "host_memory_bytes_per_s", lambda s: 64e9)
    profile, measured = calibrate.calibrate("tiny", "h200")
    assert profile["dense_gemm_efficiency"] == 1.0
    assert profile["grouped_gemm_efficiency"] == 0.5
    assert profile["attention_efficiency"] == round(0.123456789, 6)
    assert profile["hbm_efficiency"] == 0.5
    assert profile["host_memory_gbps"] == 64.0 and profile["host_adamw_efficiency"] == 0.5
    assert "dense_gemm_efficiency" in measured and profile["name"] == "h200_measured"
