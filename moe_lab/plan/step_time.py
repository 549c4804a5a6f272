"""Step time of one rank by the trace breakdown's categories (``moe_lab.metrics.trace.CATEGORIES``), and how much of
the communication is exposed.

Each category's time is its work over the rate the hardware profile gives for that kind of work:
- dense_gemm, expert_gemm, attention: FLOPs (forward, backward at twice the GEMMs' and 2.5x attention's, and the
  forward again where ac=full recomputes) over the achieved FLOP/s of each kind;
- optimizer: AdamW's 28 bytes per parameter (offload=none) over the achieved HBM bandwidth;
- pcie: offload=optimizer's moments beyond what its device ring holds (8 bytes per parameter), which the compute
  stream waits for beyond the last micro-batch's backward;
- host_step: offload=full's host AdamW over this rank's parameters kept on the host (little of it hides behind
  backward in the records: the planner adds it whole); those of its ``device_share`` step on the GPU, as
  ``optimizer``;
- ep_all_to_all: the torch dispatcher's NCCL all-to-alls (on the compute stream: exposed);
- dispatch_glue: the dispatchers' routing, permutations and, for the fused op at EP>1, the rows it pulls and pushes
  over NVLink inside its kernels (not overlapped with its GEMMs);
- fsdp_all_gather / fsdp_reduce_scatter: FSDP2's collectives, exposed where a block's collective outlasts the
  block's compute it overlaps with, and the first gather and last reduce-scatter of a step, which have nothing to
  overlap;
- other: memory-bound elementwise work (norms, RoPE, casts, the loss), in bytes per token over HBM bandwidth;
- idle: the compute stream's launch gaps, a fixed time per step (``hardware.step_overhead_ms``).
"""

from __future__ import annotations

from moe_lab.metrics.trace import CATEGORIES
from moe_lab.plan.hardware import Hardware
from moe_lab.plan.memory import Step, full_offload_chunks, fused_receive_rows, ring_params, routed_rows, routed_slots, state_bytes

# Fitted on the H200 records (experiments/plan/README.md): what each dispatcher's expert compute reaches of the
# grouped-GEMM rate (the torch dispatcher's scope holds its SwiGLU, casts and the grouped GEMM's layout copies); its
# glue's memory traffic per routed row element and pass (forward 1, backward 2, ac=full's recompute 1 more); and
# the torch dispatcher's permutation backwards outside any scope (``other``): bf16 index_add with atomics, one per
# layer (the unsort) at EP=1, three at EP>1 (and the received rows' reordering both ways), at the HBM traffic of
# this many bytes per element (10 ms per 4 layers of 131,072 rows x 2048 on the H200).
EXPERT_RATE = {"fused": 1.0, "torch": 0.72}
GLUE_BYTES_PER_ELEMENT = {"fused": 10.25, "torch": 7.3}  # per element of a routed row (H wide)
INDEX_ADD_BYTES_PER_ELEMENT = 32.0
# FP8 experts (experiments/fp8/README.md, records/h200_layer/2026-12-01_21-28.json): the quantizing kernels' extra
# traffic over the bf16 glue, per routed row element and pass (the routed gradient's quantization, the saved rows'
# dequantization, the SwiGLU kernels' FP8 outputs), and the weight copies' quantization, made once per optimizer step
# (2.3 ms for the 30B layer's 604M expert parameters on the H200: 13 bytes per parameter at the HBM rate).
FP8_GLUE_BYTES_PER_ELEMENT = 1.5
FP8_WEIGHT_QUANT_BYTES_PER_PARAM = 13.0
# The grouped GEMMs' share of peak grows with the experts' narrower side (min(H, I)): the profile's share is at the
# 30B proxy's experts (I = 768); the 235B's (I = 1536) ran at 1.16x it (experiments/moe_layer/records/h200_ep2/
# 2026-11-30_09-45.json: 735 vs 633 TFLOP/s), which a share of d / (d + 284) fits.
GROUPED_REFERENCE_WIDTH = 768
GROUPED_HALF_WIDTH = 284
OTHER_BYTES_PER_TOKEN_LAYER = 20_000.0  # norms, RoPE, residual adds: per token, layer and pass
LOSS_BYTES_PER_LOGIT = 12.0  # the compiled loss: bf16 logits read, fp32 log-softmax forward and backward
EAGER_OTHER = 3.0  # trainer.compile=false: the elementwise work unfused
CAST_BYTES_PER_PARAM = 12.0  # fp32 weights read, bf16 copies written (forward; backward reads them again or re-casts)
GRAD_CAST_BYTES_PER_PARAM = 6.0  # bf16 weight gradients widened to fp32
ATTENTION_BACKWARD = 2.5  # flash attention's backward over its forward FLOPs
ADAMW_BYTES = 28  # fp32 param, grad, exp_avg, exp_avg_sq read; param and moments written
FOREACH_ADAMW_BYTES = 60  # the same through foreach kernels, one pass per op


def grouped_shape_factor(step: Step) -> float:
    """The grouped GEMMs' rate at this model's expert shape over the rate at the profile's reference shape."""
    width = min(step.cfg.hidden_size, step.cfg.moe_intermediate_size)

    def share(d: float) -> float:
        return d / (d + GROUPED_HALF_WIDTH)

    return share(width) / share(GROUPED_REFERENCE_WIDTH)


def passes(step: Step) -> tuple[float, float]:
    """(GEMM passes, attention passes) over one forward's FLOPs: forward + backward, and ac=full's recompute."""
    recompute = 1.0 if step.ac == "full" else 0.0
    return 3.0 + recompute, 1.0 + ATTENTION_BACKWARD + recompute


def exchange_bytes(step: Step) -> float:
    """Bytes one rank sends over the EP group per micro-batch: the rows to peers each way, forward and backward, and
    again in ac=full's recompute (ac=selective keeps the exchanged rows). FP8 experts dispatch forward's rows in
    e4m3 with their scales: about half the bytes of that exchange."""
    mesh, c = step.mesh, step.cfg
    if mesh.ep == 1:
        return 0.0
    per_exchange = routed_rows(step) * 2 * c.hidden_size * (mesh.ep - 1) / mesh.ep
    dispatch = (1 + 4 / 128) / 2 if step.expert_precision == "fp8" else 1.0  # forward's dispatch, of a bf16 exchange
    exchanges = 3 + dispatch + ((1 + dispatch) if step.ac == "full" else 0)
    return c.num_layers * exchanges * per_exchange


def exchange_seconds(step: Step, hw: Hardware) -> float:
    """The EP exchange's time: a rank sends to its peers at once, those in its node over NVLink and those on other
    nodes (EP groups wider than a node) over its NIC; the slower share sets the time."""
    mesh, sent = step.mesh, exchange_bytes(step)
    if not mesh.ep_across_nodes:
        return sent / hw.link_bytes_per_s(False)
    remote = (mesh.ep - mesh.gpus_per_node) / (mesh.ep - 1)
    return max((1 - remote) * sent / hw.link_bytes_per_s(False), remote * sent / hw.link_bytes_per_s(True))


def fsdp_bytes(step: Step) -> dict[str, tuple[float, bool]]:
    """Bytes each rank receives (all-gather) and sends (reduce-scatter) per step, each with whether it crosses
    nodes. Dense weights gather over all ranks; experts over the ``world // ep`` ranks that shard them."""
    s, mesh = step.shapes, step.mesh
    if mesh.world == 1:
        return {}
    dense = s.outside_params + s.cfg.num_layers * s.dense_layer_params
    experts = s.cfg.num_layers * s.expert_layer_params / mesh.ep
    micro = step.grad_accum
    gathers = 1 if step.keep_unsharded else 2 * micro  # forward, and again for backward (the LM head stays gathered)
    reduces = 1 if step.grad_sync == "step" else micro
    frac_dense = (mesh.world - 1) / mesh.world
    frac_experts = (mesh.expert_shard - 1) / mesh.expert_shard
    out = {
        "dense all_gather": (2 * dense * frac_dense * gathers, mesh.dense_across_nodes),
        "dense reduce_scatter": (4 * dense * frac_dense * reduces, mesh.dense_across_nodes),
        "expert all_gather": (2 * experts * frac_experts * gathers, mesh.expert_shard_across_nodes),
        "expert reduce_scatter": (4 * experts * frac_experts * reduces, mesh.expert_shard_across_nodes),
    }
    return out


def moe_seconds(step: Step, hw: Hardware) -> dict[str, float]:
    """One micro-batch's time in the MoE blocks' dispatch, experts and combine, by category: the grouped GEMMs, the
    dispatcher's glue (with the fused op's exchange, which its kernels do), the torch dispatcher's all-to-all, and
    its permutation backwards (``index_add``, which the trace puts in ``other``)."""
    c, mesh = step.cfg, step.mesh
    gemm_passes, _ = passes(step)
    expert_rate = hw.flops("grouped_gemm") * EXPERT_RATE[step.dispatcher] * grouped_shape_factor(step)
    # Rows the kernels move (the fused op's padded received rows; a worst-case buffer's unused rows are skipped).
    rows = fused_receive_rows(step, worst_case=False) if step.dispatcher == "fused" else routed_rows(step)
    glue_per_element = GLUE_BYTES_PER_ELEMENT[step.dispatcher]
    if step.expert_precision == "fp8":
        glue_per_element += FP8_GLUE_BYTES_PER_ELEMENT
    glue_bytes = c.num_layers * gemm_passes * rows * c.hidden_size * glue_per_element
    exchange = exchange_seconds(step, hw)
    index_adds = (3 if mesh.ep > 1 else 1) if step.dispatcher == "torch" else 0
    # the busiest rank's rows (skewed routing) over the rows it routes
    pass_flops = step.shapes.expert_flops(step.tokens) * routed_rows(step) / routed_slots(step)
    if step.expert_precision == "fp8":  # every pass but the weight gradients' (bf16) at the FP8 rate
        fp8_rate = hw.flops("fp8_grouped_gemm") * grouped_shape_factor(step)
        expert_gemm = (gemm_passes - 1) * pass_flops / fp8_rate + pass_flops / expert_rate
    else:
        expert_gemm = gemm_passes * pass_flops / expert_rate
    return {
        "expert_gemm": expert_gemm,
        "dispatch_glue": glue_bytes / hw.hbm_bytes_per_s + (exchange if step.dispatcher == "fused" else 0.0),
        "ep_all_to_all": exchange if step.dispatcher == "torch" else 0.0,
        "other": c.num_layers * index_adds * rows * c.hidden_size * INDEX_ADD_BYTES_PER_ELEMENT / hw.hbm_bytes_per_s,
    }


def plan_time(step: Step, hw: Hardware) -> dict:
    s, c, mesh = step.shapes, step.cfg, step.mesh
    t, micro = step.tokens, step.grad_accum
    gemm_passes, attention_passes = passes(step)
    layer_dense = s.layer_dense_flops(t)
    head = s.dense_flops(t) - layer_dense
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    seconds["dense_gemm"] = micro * (gemm_passes * layer_dense + 3 * head) / hw.flops("dense_gemm")
    seconds["attention"] = micro * attention_passes * s.attention_flops(t, step.seq_len) / hw.flops("attention")
    for category, value in moe_seconds(step, hw).items():
        seconds[category] += micro * value
    if step.expert_precision == "fp8":  # the weight copies, once per optimizer step
        local_experts = c.num_layers * s.expert_layer_params / mesh.ep
        seconds["dispatch_glue"] += local_experts * FP8_WEIGHT_QUANT_BYTES_PER_PARAM / hw.hbm_bytes_per_s
    exchange = micro * exchange_seconds(step, hw)
    elementwise = c.num_layers * gemm_passes * t * OTHER_BYTES_PER_TOKEN_LAYER  # per pass, as the glue
    if not step.compile:
        elementwise *= EAGER_OTHER
    seconds["other"] += micro * (elementwise + t * LOSS_BYTES_PER_LOGIT * c.vocab_size) / hw.hbm_bytes_per_s

    n = s.local_params(mesh)
    if step.offload == "none":
        per_param = FOREACH_ADAMW_BYTES if step.foreach else ADAMW_BYTES
        seconds["optimizer"] = n * (per_param if step.optimizer == "adamw" else 12) / hw.hbm_bytes_per_s
    elif step.offload == "optimizer":
        seconds["optimizer"] = n * ADAMW_BYTES / hw.hbm_bytes_per_s  # its exposed PCIe follows the compute, below
    else:  # its device chunks step on the GPU as the optimizer does under offload=optimizer, the rest on the host
        host_chunks, device_chunks = full_offload_chunks(step)
        seconds["optimizer"] = sum(device_chunks) * ADAMW_BYTES / hw.hbm_bytes_per_s
        ranks_on_node = min(mesh.world, mesh.gpus_per_node)
        seconds["host_step"] = sum(host_chunks) / hw.host_adamw_params_per_s(ranks_on_node)

    # Weights cast to bf16 and weight gradients widened to fp32: autocast's casts on one rank (``other``), FSDP2's
    # copy-in and copy-out around its collectives (on the compute stream, in their scopes) on more.
    n_unsharded = s.outside_params + c.num_layers * s.layer_params_unsharded(mesh)
    casts = {"fsdp_all_gather": 0.0, "fsdp_reduce_scatter": 0.0}
    if mesh.world == 1:
        if step.offload != "full":
            seconds["other"] += micro * (CAST_BYTES_PER_PARAM + GRAD_CAST_BYTES_PER_PARAM) * n / hw.hbm_bytes_per_s
    else:
        gathers = 1 if step.keep_unsharded else 2 * micro
        casts["fsdp_all_gather"] = gathers * 6 * n / hw.hbm_bytes_per_s
        casts["fsdp_reduce_scatter"] = (1 if step.grad_sync == "step" else micro) * GRAD_CAST_BYTES_PER_PARAM * n_unsharded / hw.hbm_bytes_per_s

    compute = sum(seconds[k] for k in ("dense_gemm", "expert_gemm", "attention", "dispatch_glue", "other"))
    if step.offload == "optimizer":
        # The ring's worth of state comes in under the earlier micro-batches; the rest comes in during the last
        # micro-batch's backward as chunks step and free their place (the new state going home in the other
        # direction, and on into the next step, where the host reads no longer wait for it): what that backward,
        # about two thirds of a micro-batch's compute, does not cover is exposed (experiments/offload_accum).
        seconds["pcie"] = max(0.0, state_bytes(step) * (n - ring_params(step)) / hw.pcie_bytes_per_s - compute / micro * 2 / 3)
    exposed, total_comm = fsdp_exposed(step, hw, compute)
    seconds.update({k: exposed[k] + casts[k] for k in exposed})
    seconds["idle"] = hw.step_overhead_ms / 1e3
    step_s = sum(seconds.values())
    # Communication proper (FSDP2's casts are compute-stream work in its scopes): the EP exchange is never
    # overlapped, by either dispatcher; FSDP2's collectives where they outlast the compute beside them.
    total = {**total_comm, "ep_all_to_all": exchange}
    exposed_comm = {**exposed, "ep_all_to_all": exchange}
    return {
        "step_s": step_s,
        "seconds": seconds,
        "communication_s": total,
        "exposed_communication_s": exposed_comm,
        "exposed_fraction": sum(exposed_comm.values()) / sum(total.values()) if sum(total.values()) else 0.0,
    }


def fsdp_exposed(step: Step, hw: Hardware, compute: float) -> tuple[dict, dict]:
    """FSDP2's collectives run on their own streams while blocks compute. A block's gather (and in backward its
    reduce-scatter) overlaps the neighbouring block's compute; what a block's collectives take beyond that is
    exposed, and so are the step's first gather (embedding and first block, nothing before them) and its last
    reduce-scatter (the embedding's, nothing after it)."""
    parts = fsdp_bytes(step)
    if not parts:
        return {"fsdp_all_gather": 0.0, "fsdp_reduce_scatter": 0.0}, {"fsdp_all_gather": 0.0, "fsdp_reduce_scatter": 0.0}
    gather = sum(b / hw.link_bytes_per_s(x) for k, (b, x) in parts.items() if "all_gather" in k)
    reduce = sum(b / hw.link_bytes_per_s(x) for k, (b, x) in parts.items() if "reduce_scatter" in k)
    layers = step.cfg.num_layers + 2  # blocks, embedding, head
    per_group_compute = compute / layers
    s, mesh = step.shapes, step.mesh
    first = 2 * (s.embedding_params + s.layer_params_unsharded(mesh)) * (mesh.world - 1) / mesh.world
    last = 4 * s.embedding_params * (mesh.world - 1) / mesh.world
    across = mesh.dense_across_nodes
    # Backward holds the reduce-scatters and half the gathers; both share the links with each other.
    exposed_gather = max(0.0, gather - (compute - per_group_compute)) + first / hw.link_bytes_per_s(across)
    exposed_reduce = max(0.0, reduce + gather / 2 - compute * 2 / 3) + last / hw.link_bytes_per_s(across)
    return (
        {"fsdp_all_gather": min(gather, exposed_gather), "fsdp_reduce_scatter": min(reduce, exposed_reduce)},
        {"fsdp_all_gather": gather, "fsdp_reduce_scatter": reduce},
    )
