"""Step time of one rank by the trace breakdown's categories (``moe_lab.metrics.trace.CATEGORIES``), and how much of
the communication is exposed.

Each category's time is its work over the rate the hardware profile gives for that kind of work:
- dense_gemm, expert_gemm, attention: FLOPs (forward, backward at twice the GEMMs' and 2.5x attention's, and the
  forward again where ac=full recomputes) over the achieved FLOP/s of each kind (precision=fp8's attention
  projections at the FP8 dense rate, the experts' FP8 passes at the FP8 grouped rate; attention's rate falls below
  the profile's at sequences shorter than calibrate's);
- optimizer: AdamW's 28 bytes per parameter (offload=none) over the achieved HBM bandwidth;
- pcie: offload=optimizer's moments beyond what its device ring holds (8 bytes per parameter), which the compute
  stream waits for beyond the last micro-batch's backward; ``ac.offload_activations``' copies out and back (one
  side stream, overlapped with the micro-batch's compute: exposed beyond it, and at least the profile's
  ``activation_offload_exposed`` share of the copies' time);
- recompute: ac=full's forward again; under ac=selective the forward of the sets ``ac.keep`` leaves out; with
  ``dispatcher.save`` rows_only / inputs the fused op's gate/up GEMM (2/3 of the experts' forward) in backward and,
  for gate_up / inputs, its row gather (and the rows' exchange at EP > 1) again;
- host_step: offload=full's host AdamW over this rank's parameters kept on the host (little of it hides behind
  backward in the records: the planner adds it whole); those of its ``device_share`` step on the GPU, as
  ``optimizer``;
- ep_all_to_all: the torch dispatcher's NCCL all-to-alls (on the compute stream: exposed);
- dispatch_glue: the dispatchers' routing, permutations and, for the fused op at EP>1, the rows it pulls and pushes
  over NVLink inside its kernels (not overlapped with its GEMMs);
- fsdp_all_gather / fsdp_reduce_scatter: FSDP2's collectives inside a replica (``parallel.dp_replicate``), and
  in fsdp_reduce_scatter with replicas (HSDP) the all-reduce of each rank's gradient shard across them, over the
  inter-node links where the ranks of a collective span nodes; exposed where a block's collectives outlast the
  block's compute they overlap with, and the first gather and last reduction of a step, which have nothing to
  overlap;
- other: memory-bound elementwise work (norms, RoPE, casts, the loss: its option's model), in bytes per token over
  HBM bandwidth; the LM head's GEMMs are three passes under either loss (chunked runs backward's two in forward);
- idle: the compute stream's launch gaps, a fixed time per step (``hardware.step_overhead_ms``).

What an option changes (a dispatcher's rates and exchange, an AC mode's recompute, an offload mode's optimizer step
and copies) is its planner model's (``moe_lab.plan.models``), asked for the step at hand.
"""

from __future__ import annotations

from moe_lab.metrics.trace import CATEGORIES
from moe_lab.plan.hardware import Hardware
from moe_lab.plan.memory import Step, offloaded_bytes, routed_rows, routed_slots

# The grouped GEMMs' share of peak grows with the experts' narrower side (min(H, I)): the profile's share is at the
# 30B proxy's experts (I = 768); the 235B's (I = 1536) ran at 1.16x it (experiments/moe_layer/records/h200_ep2/
# 2026-11-30_09-45.json: 735 vs 633 TFLOP/s), which a share of d / (d + 284) fits.
GROUPED_REFERENCE_WIDTH = 768
GROUPED_HALF_WIDTH = 284
OTHER_BYTES_PER_TOKEN_LAYER = 20_000.0  # norms, RoPE, residual adds: per token, layer and pass
EAGER_OTHER = 3.0  # trainer.compile=false: the elementwise work unfused
CAST_BYTES_PER_PARAM = 12.0  # fp32 weights read, bf16 copies written (forward; backward reads them again or re-casts)
GRAD_CAST_BYTES_PER_PARAM = 6.0  # bf16 weight gradients widened to fp32
# FSDP2's work around its collectives as the compute stream sees it, per unsharded parameter of a rank: a gather's
# copy-out (bf16 read and written) beside its cast and the gather's own writes; a reduction's copy-in to fp32 and
# what follows it. Fitted on reference_30b's emulated rank 0 of 8, fused + selective, traced at EP 1 (experts
# sharded: 30.5 B unsharded parameters a rank; 107 + 116 ms) and EP 8 (5.2 B; 8 + 31 ms) within 5 %
# (experiments/emulate/records/h200_rank0_of_8/2026-12-04_20-24_ep_trace); billed by the local shard, as before,
# EP 1's 223 ms were planned as 74.
FSDP_GATHER_BYTES_PER_PARAM = 6.0
FSDP_REDUCE_BYTES_PER_PARAM = 13.0
ATTENTION_BACKWARD = 2.5  # flash attention's backward over its forward FLOPs
# Flash attention's share of peak falls at shorter sequences (fewer tiles a head, the causal diagonal a larger part):
# the profile's rate is at ATTENTION_REFERENCE_SEQ, the sequence calibrate measures it at; the full-depth share's
# attention at seq 4096 x 4 took 1.25x what that rate gives, in both precisions
# (experiments/tune/records/h200_1gpu_share/2026-12-04_20-56_trace: 209-214 ms against 170), which a share of
# s / (s + 1460) fits. Longer sequences keep the profile's rate (seq 32768's points are planned within 1.6 % at it).
ATTENTION_REFERENCE_SEQ = 16384
ATTENTION_HALF_SEQ = 1460


def attention_seq_factor(seq_len: int) -> float:
    """Attention's rate at ``seq_len`` over the profile's (at ``ATTENTION_REFERENCE_SEQ``), at most 1."""

    def share(s: float) -> float:
        return s / (s + ATTENTION_HALF_SEQ)

    return min(1.0, share(seq_len) / share(ATTENTION_REFERENCE_SEQ))


def grouped_shape_factor(step: Step) -> float:
    """The grouped GEMMs' rate at this model's expert shape over the rate at the profile's reference shape."""
    width = min(step.cfg.hidden_size, step.cfg.moe_intermediate_size)

    def share(d: float) -> float:
        return d / (d + GROUPED_HALF_WIDTH)

    return share(width) / share(GROUPED_REFERENCE_WIDTH)


GATE_UP_SHARE = 2 / 3  # of the experts' forward FLOPs: gate/up [2I, H] beside down [H, I]
GATHER_BYTES_PER_ELEMENT = 4.0  # the fused op's row gather again in backward (save=inputs): bf16 read and written


def passes(step: Step, part: str = "dense") -> float:
    """Passes over one forward's FLOPs of ``part`` (dense | attention | dispatcher | experts): forward + backward
    (2.5x for attention), and what the AC mode recomputes of it."""
    base = 1.0 + ATTENTION_BACKWARD if part == "attention" else 3.0
    return base + step.ac.recomputed(step, part)


def exchange_bytes(step: Step) -> float:
    """Bytes one rank sends over the EP group per micro-batch: the rows to peers each way, forward and backward, and
    again in ac=full's recompute (ac=selective keeps the exchanged rows). FP8 experts dispatch forward's rows in
    e4m3 with their scales: about half the bytes of that exchange."""
    mesh, c = step.mesh, step.cfg
    if mesh.ep == 1:
        return 0.0
    per_exchange = routed_rows(step) * 2 * c.hidden_size * (mesh.ep - 1) / mesh.ep
    rebuild = step.dispatcher.backward_rebuild(step)
    dispatch = step.dispatcher.dispatch_exchange_share(step)  # forward's dispatch, of a bf16 exchange
    exchanges = 3 + dispatch + step.ac.recomputed(step, "dispatcher") * (1 + dispatch) + rebuild["exchanges"]
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
    """Bytes each rank receives (all-gather) and sends (reduce-scatter, all-reduce) per step, each with whether it
    crosses nodes. Dense weights gather over a replica's ranks; experts over the replica's ``shard // ep`` ranks
    that shard them; with replicas (HSDP) each rank's reduced shard of the gradients is all-reduced (a ring: twice
    its fp32 bytes) with the ranks holding the same shard in the other replicas, once per step."""
    s, mesh = step.shapes, step.mesh
    if mesh.world == 1:
        return {}
    dense = s.outside_params + s.cfg.num_layers * s.dense_layer_params
    experts = s.cfg.num_layers * s.expert_layer_params / mesh.ep
    micro = step.grad_accum
    gathers = 2 * micro if step.reshard_after_forward else 1  # forward, and again for backward (not the LM head)
    reduces = 1 if step.grad_sync == "step" else micro
    frac_dense = (mesh.shard - 1) / mesh.shard
    frac_experts = (mesh.expert_shard - 1) / mesh.expert_shard
    out = {
        "dense all_gather": (2 * dense * frac_dense * gathers, mesh.dense_across_nodes),
        "dense reduce_scatter": (4 * dense * frac_dense * reduces, mesh.dense_across_nodes),
        "expert all_gather": (2 * experts * frac_experts * gathers, mesh.expert_shard_across_nodes),
        "expert reduce_scatter": (4 * experts * frac_experts * reduces, mesh.expert_shard_across_nodes),
    }
    if mesh.dp_replicate > 1:
        frac_replicas = (mesh.dp_replicate - 1) / mesh.dp_replicate
        held = (dense / mesh.shard + experts / mesh.expert_shard) * 4  # this rank's fp32 gradient shard
        out["replicate all_reduce"] = (2 * held * frac_replicas, mesh.replicate_across_nodes)
    return out


def moe_seconds(step: Step, hw: Hardware) -> dict[str, float]:
    """One micro-batch's time in the MoE blocks' dispatch, experts and combine, by category: the grouped GEMMs, the
    dispatcher's glue (with the fused op's exchange, which its kernels do), the torch dispatcher's all-to-all, and
    its permutations (billed in ``other``)."""
    c, dispatcher = step.cfg, step.dispatcher
    rebuild = dispatcher.backward_rebuild(step)  # what its backward runs again beyond the AC mode's recompute
    expert_passes = passes(step, "experts") + GATE_UP_SHARE * rebuild["gate_up"]
    expert_rate = hw.flops("grouped_gemm") * dispatcher.expert_rate * grouped_shape_factor(step)
    rows = dispatcher.kernel_rows(step)
    glue_per_row = passes(step, "dispatcher") * dispatcher.glue_bytes_per_element(step)
    glue_per_row += rebuild["gathers"] * GATHER_BYTES_PER_ELEMENT
    glue_bytes = c.num_layers * rows * c.hidden_size * glue_per_row
    exchange = exchange_seconds(step, hw)
    # the busiest rank's rows (skewed routing) over the rows it routes
    pass_flops = step.shapes.expert_flops(step.tokens) * routed_rows(step) / routed_slots(step)
    expert_gemm = pass_flops / expert_rate * expert_passes
    if fp8_passes := dispatcher.fp8_passes(step, expert_passes):
        fp8_rate = hw.flops("fp8_grouped_gemm") * grouped_shape_factor(step)
        expert_gemm = pass_flops * (fp8_passes / fp8_rate + (expert_passes - fp8_passes) / expert_rate)
    return {
        "expert_gemm": expert_gemm,
        "dispatch_glue": glue_bytes / hw.hbm_bytes_per_s + (exchange if dispatcher.exchange_in_kernels else 0.0),
        "ep_all_to_all": 0.0 if dispatcher.exchange_in_kernels else exchange,
        "other": c.num_layers
        * dispatcher.permutation_bytes_per_element(step)
        * rows
        * c.hidden_size
        / hw.hbm_bytes_per_s,
    }


def plan_time(step: Step, hw: Hardware) -> dict:
    s, c, mesh = step.shapes, step.cfg, step.mesh
    t, micro = step.tokens, step.grad_accum
    layer_dense = s.layer_dense_flops(t)
    head = s.dense_flops(t) - layer_dense
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    fp8_dense = step.precision.fp8_dense_flops(step)  # precision=fp8: the attention projections at the FP8 rate
    bf16_dense = passes(step, "dense") * (layer_dense - fp8_dense) + 3 * head
    seconds["dense_gemm"] = micro * bf16_dense / hw.flops("dense_gemm")
    if fp8_dense:
        seconds["dense_gemm"] += micro * passes(step, "dense") * fp8_dense / hw.flops("fp8_dense_gemm")
    attention_flops = passes(step, "attention") * s.attention_flops(t, step.seq_len)
    seconds["attention"] = micro * attention_flops / (hw.flops("attention") * attention_seq_factor(step.seq_len))
    for category, value in moe_seconds(step, hw).items():
        seconds[category] += micro * value
    seconds["dispatch_glue"] += step.dispatcher.per_step_glue_bytes(step) / hw.hbm_bytes_per_s  # once per step
    exchange = micro * exchange_seconds(step, hw)
    elementwise_passes = 3.0 + step.ac.recompute_passes  # ac=full runs them again; selective keeps its own
    elementwise = c.num_layers * elementwise_passes * t * OTHER_BYTES_PER_TOKEN_LAYER  # per pass, as the glue
    if not step.compile:
        elementwise *= EAGER_OTHER
    seconds["other"] += micro * (elementwise + step.loss.traffic_bytes(step)) / hw.hbm_bytes_per_s

    n = s.local_params(mesh)
    seconds.update(step.offload.optimizer_seconds(step, hw, n))

    # Weights cast to bf16 and weight gradients widened to fp32: autocast's casts on one rank (``other``), FSDP2's
    # copy-in and copy-out around its collectives (on the compute stream, in their scopes) on more.
    n_unsharded = s.outside_params + c.num_layers * s.layer_params_unsharded(mesh)
    casts = {"fsdp_all_gather": 0.0, "fsdp_reduce_scatter": 0.0}
    if mesh.world == 1:
        if step.offload.fp32_weights_on_device:
            # FP8 experts' stacks are quantized from fp32 (per_step_glue_bytes), not cast; the op widens their
            # gradients itself (in its scope)
            fp8 = step.dispatcher.fp8_expert_params(step)
            seconds["other"] += (
                micro * (CAST_BYTES_PER_PARAM + GRAD_CAST_BYTES_PER_PARAM) * (n - fp8) / hw.hbm_bytes_per_s
            )
            seconds["dispatch_glue"] += micro * GRAD_CAST_BYTES_PER_PARAM * fp8 / hw.hbm_bytes_per_s
    else:
        gathers = 2 * micro if step.reshard_after_forward else 1
        reduces = 1 if step.grad_sync == "step" else micro
        casts["fsdp_all_gather"] = gathers * FSDP_GATHER_BYTES_PER_PARAM * n_unsharded / hw.hbm_bytes_per_s
        casts["fsdp_reduce_scatter"] = reduces * FSDP_REDUCE_BYTES_PER_PARAM * n_unsharded / hw.hbm_bytes_per_s

    compute = sum(seconds[k] for k in ("dense_gemm", "expert_gemm", "attention", "dispatch_glue", "other"))
    seconds["pcie"] += step.offload.exposed_pcie(step, hw, n, compute)
    # ac.offload_activations: out in forward, back in backward, on one side stream beside the micro-batch's compute:
    # what outlasts the compute, and at least the share of the copies the records show through it
    copies = 2 * offloaded_bytes(step) / hw.pcie_bytes_per_s
    seconds["pcie"] += micro * max(copies - compute / micro, hw.activation_offload_exposed * copies)
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
    reduce-scatter, and with replicas its all-reduce after it) overlaps the neighbouring block's compute; what a
    block's collectives take beyond that is exposed, and so are the step's first gather (embedding and first block,
    nothing before them) and its last reduction (the embedding's, nothing after it)."""
    parts = fsdp_bytes(step)
    if not parts:
        return {"fsdp_all_gather": 0.0, "fsdp_reduce_scatter": 0.0}, {
            "fsdp_all_gather": 0.0,
            "fsdp_reduce_scatter": 0.0,
        }
    # Seconds on each link (NVLink: False, the NICs: True) by kind; one link's collectives queue behind each other.
    seconds = {(kind, across): 0.0 for kind in ("gather", "reduce") for across in (False, True)}
    for k, (b, across) in parts.items():
        seconds["gather" if "all_gather" in k else "reduce", across] += b / hw.link_bytes_per_s(across)
    gather = seconds["gather", False] + seconds["gather", True]
    reduce = seconds["reduce", False] + seconds["reduce", True]
    # in backward: the reductions and half the gathers, each link its own (HSDP's all-reduce on the NICs beside the
    # replica's reduce-scatters on NVLink)
    backward = max(seconds["reduce", x] + seconds["gather", x] / 2 for x in (False, True))
    layers = step.cfg.num_layers + 2  # blocks, embedding, head
    per_group_compute = compute / layers
    s, mesh = step.shapes, step.mesh
    # the first block's gather, before any compute to hide it: dense weights over the replica, experts over the
    # ranks that shard them (none where EP spans the replica)
    across = mesh.dense_across_nodes
    first = (
        2 * (s.embedding_params + s.dense_layer_params) * (mesh.shard - 1) / mesh.shard / hw.link_bytes_per_s(across)
    )
    expert_share = (mesh.expert_shard - 1) / mesh.expert_shard
    first += 2 * s.expert_layer_params / mesh.ep * expert_share / hw.link_bytes_per_s(mesh.expert_shard_across_nodes)
    last = 4 * s.embedding_params * (mesh.shard - 1) / mesh.shard / hw.link_bytes_per_s(across)
    if mesh.dp_replicate > 1:  # the embedding's shard all-reduced across replicas after its reduce-scatter
        replicas = (mesh.dp_replicate - 1) / mesh.dp_replicate
        last += 8 * s.embedding_params / mesh.shard * replicas / hw.link_bytes_per_s(mesh.replicate_across_nodes)
    exposed_gather = max(0.0, gather - (compute - per_group_compute)) + first
    exposed_reduce = max(0.0, backward - compute * 2 / 3) + last
    return (
        {"fsdp_all_gather": min(gather, exposed_gather), "fsdp_reduce_scatter": min(reduce, exposed_reduce)},
        {"fsdp_all_gather": gather, "fsdp_reduce_scatter": reduce},
    )


def offload_pace(step: Step, hw: Hardware) -> float:
    """With ``ac.offload_activations``: the share of forward's saved bytes PCIe takes to the host while forward
    (a third of a micro-batch's compute) runs; what it has not taken by the loss is still on the device."""
    sent = offloaded_bytes(step)
    if not sent:
        return 1.0
    seconds = plan_time(step, hw)["seconds"]
    compute = sum(seconds[k] for k in ("dense_gemm", "expert_gemm", "attention", "dispatch_glue", "other"))
    compute /= step.grad_accum
    return min(1.0, compute / 3 / (sent / hw.pcie_bytes_per_s))
