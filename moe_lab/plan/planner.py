"""A plan of one configuration: its options validated as ``moe_lab.train`` validates them, then memory (``memory``)
and step time (``step_time``) per rank on the hardware profile's mesh, and the deepest model and longest sequence
that fit under each offload mode.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from functools import partial

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from moe_lab import config
from moe_lab.config import ConfigError, Options
from moe_lab.config.validate import check_target_node
from moe_lab.moe.fused.fp8_ops import PLANNED_HARDWARE
from moe_lab.metrics.flops import flops_per_token
from moe_lab.moe.dispatcher import FusedDispatcher, TorchDispatcher
from moe_lab.moe.fused.ops import ALIGN
from moe_lab.moe.router import Router
from moe_lab.optim.offload import FullOffload, NoOffload, OptimizerOffload
from moe_lab.optim.offload.host import HOST_RESERVE
from moe_lab.optim.optimizers import SignSGD
from moe_lab.parallel.ac import GENERIC_SAVED_OPS, FullCheckpoint, NoCheckpoint, SelectiveCheckpoint
from moe_lab.plan.hardware import GIB, Hardware
from moe_lab.plan.memory import Step, plan_memory
from moe_lab.plan.shapes import Mesh, Shapes
from moe_lab.plan.step_time import plan_time

DISPATCHERS = {TorchDispatcher: "torch", FusedDispatcher: "fused"}
ACS = {NoCheckpoint: "none", SelectiveCheckpoint: "selective", FullCheckpoint: "full"}
OFFLOADS = {NoOffload: "none", OptimizerOffload: "optimizer", FullOffload: "full"}
OFFLOAD_MODES = ("none", "optimizer", "full")


def build_hardware(node, nproc_per_node: int = 1) -> Hardware:
    """The ``hardware`` group's option, built, its construction errors naming their key; a mesh that leaves
    ``gpus_per_node`` to the job gets the job's ``trainer.nproc_per_node``."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError("hardware", "must be a hardware group option (hardware=h200|h100|b200|b300|file)")
    check_target_node("hardware", node)
    try:
        return instantiate(node).on_mesh(nproc_per_node)
    except Exception as e:
        if isinstance(e.__cause__, ConfigError):  # Hydra wraps what a constructor raises
            raise e.__cause__ from None
        raise


@contextlib.contextmanager
def job_of(hw: Hardware):
    """Validation sees the plan's mesh as the job's ranks, as it sees an outer launcher's (WORLD_SIZE), and knows
    the GPU is the profile's, not this machine's (PLANNED_HARDWARE: checks of the GPU in hand stand aside)."""
    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", PLANNED_HARDWARE)}
    os.environ["WORLD_SIZE"], os.environ["LOCAL_WORLD_SIZE"] = str(hw.gpus), str(hw.gpus_per_node)
    os.environ[PLANNED_HARDWARE] = hw.name
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def train_config(cfg: DictConfig) -> DictConfig:
    """The training config the plan is of: without the ``hardware`` node, and set for a GPU whatever this machine
    has (``trainer.device=auto``; ``trainer.precision=auto`` is bf16 there)."""
    if cfg.trainer.device == "cpu":
        raise ConfigError("trainer.device", "the planner predicts GPU runs; use auto or cuda")
    train = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in ("hardware", "hydra")])
    train.trainer.device = "auto"
    if train.trainer.precision == "fp32":
        raise ConfigError("trainer.precision", "the planner predicts bf16 runs; use auto or bf16")
    train.trainer.precision = "bf16"
    return train


def validated(cfg: DictConfig, hw: Hardware) -> tuple[DictConfig, Options]:
    train = train_config(cfg)
    with job_of(hw):
        options = config.validate(train)
    return train, options


def step_of(train: DictConfig, options: Options, hw: Hardware, **changes) -> Step:
    """The plan's description of one rank's step; ``changes``: Step fields to set otherwise."""
    model = options.model
    kind = {name: _kind(table, getattr(options, name), name) for name, table in
            (("dispatcher", DISPATCHERS), ("ac", ACS), ("offload", OFFLOADS))}  # fmt: skip
    opt = options.make_optimizer
    opt_class = opt.func if isinstance(opt, partial) else opt
    if opt_class not in (SignSGD,) and getattr(opt_class, "__name__", "") != "AdamW":
        raise ConfigError("optimizer._target_", f"the planner models torch.optim.AdamW and SignSGD, got {opt_class}")
    keywords = opt.keywords if isinstance(opt, partial) else {}
    dispatcher = options.dispatcher
    # The GPU's backend choice (moe_lab.moe.fused.gpu_backend_name), DeepGEMM taken as importable there
    deep_gemm = kind["dispatcher"] == "fused" and dispatcher.gemm != "torch" and (dispatcher.gemm == "deep_gemm" or train.parallel.ep == 1)
    expert_precision = getattr(dispatcher, "expert_precision", "bf16")
    if expert_precision == "fp8":
        deep_gemm = True  # the FP8 path has DeepGEMM's GEMMs only
        if hw.peak_fp8_tflops is None:
            raise ConfigError("hardware.peak_fp8_tflops", f"dispatcher.expert_precision=fp8 is planned at the FP8 peak, which hardware={hw.name} does not set")
    align = ALIGN["gpu_deep_gemm" if deep_gemm else "gpu"]
    if kind["dispatcher"] == "fused" and train.parallel.ep > hw.gpus_per_node:
        raise ConfigError(
            "parallel.ep",
            f"the fused dispatcher exchanges rows through peer GPUs' memory over NVLink: its EP group must fit in a node "
            f"(hardware.gpus_per_node={hw.gpus_per_node}), got {train.parallel.ep}; use dispatcher=torch across nodes",
        )
    offload = options.offload
    step = Step(
        shapes=Shapes(model),
        mesh=Mesh(world=hw.gpus, gpus_per_node=hw.gpus_per_node, ep=train.parallel.ep),
        seq_len=train.data.seq_len,
        batch_size=train.data.batch_size,
        grad_accum=train.trainer.grad_accum,
        dispatcher=kind["dispatcher"],
        ac=kind["ac"],
        offload=kind["offload"],
        optimizer="signsgd" if opt_class is SignSGD else "adamw",
        foreach=not keywords.get("fused", False),
        compile=train.trainer.compile,
        saved_ops=frozenset(GENERIC_SAVED_OPS | Router.saved_ops | dispatcher.saved_ops),
        fused_align=align,
        expert_precision=expert_precision,
        grad_sync=train.parallel.grad_sync,
        keep_unsharded=train.parallel.keep_unsharded,
        **chunking(offload),
    )
    return dataclasses.replace(step, **changes)


def chunking(offload) -> dict:
    """The Step fields an offload option sets: its chunk size and chunks in flight (offload=none has neither), and
    offload=full's share of the parameters stepped on the device."""
    if isinstance(offload, NoOffload):
        return {}
    fields = {"chunk_mib": offload.chunk_mib, "max_inflight": offload.max_inflight}
    if isinstance(offload, FullOffload):
        fields["device_share"] = offload.device_share
    return fields


def _kind(table: dict, option, key: str) -> str:
    for cls, name in table.items():
        if isinstance(option, cls):
            return name
    raise ConfigError(f"{key}._target_", f"the planner has no model of {type(option).__name__}; it knows {', '.join(c.__name__ for c in table)}")


HOST_PROCESS = 1.5 * GIB  # a training process's own resident memory (torch, CUDA runtime), the records' offload=none RSS
ALLOCATOR_SLACK = 0.025  # reserved but unallocated: the caching allocator's fragmentation at the edge (H200 depth search)


def usable_device_bytes(hw: Hardware) -> float:
    return (hw.hbm_gib - hw.context_gib) * GIB


def usable_host_bytes(hw: Hardware) -> float:
    """What offload's host check allows (the available memory less ``HOST_RESERVE`` of the total), shared by a node's
    ranks."""
    return (hw.host_memory_gib * (1 - HOST_RESERVE) - hw.host_memory_in_use_gib) * GIB


def fits(step: Step, hw: Hardware) -> tuple[bool, str]:
    memory = plan_memory(step)
    ranks_on_node = min(step.mesh.world, step.mesh.gpus_per_node)
    device = memory.device_total + ALLOCATOR_SLACK * memory.peak
    if device > usable_device_bytes(hw):
        return False, f"device: {device / GIB:.1f} GiB with allocator slack > {usable_device_bytes(hw) / GIB:.1f} GiB usable"
    host = (memory.host_total + HOST_PROCESS) * ranks_on_node
    if host > usable_host_bytes(hw):
        return False, f"host: {host / GIB:.1f} GiB per node > {usable_host_bytes(hw) / GIB:.1f} GiB usable"
    return True, "fits"


def largest(step: Step, hw: Hardware, field: str, low: int, high: int, multiple: int = 1) -> int | None:
    """The largest value of ``num_layers`` or ``seq_len`` in [low, high] (a multiple of ``multiple``) that fits;
    None when even ``low`` does not. Memory grows with either, so a bisection finds it."""
    def ok(value: int) -> bool:
        return fits(_with(step, field, value * multiple), hw)[0]

    lo, hi = low // multiple, high // multiple
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo * multiple


def _with(step: Step, field: str, value: int) -> Step:
    if field == "num_layers":
        return dataclasses.replace(step, shapes=Shapes(dataclasses.replace(step.cfg, num_layers=value)))
    return dataclasses.replace(step, **{field: value})


def offload_step(step: Step, mode: str, options_offload) -> Step:
    defaults = {"none": NoOffload(), "optimizer": OptimizerOffload(), "full": FullOffload()}
    offload = options_offload if OFFLOADS.get(type(options_offload)) == mode else defaults[mode]
    return dataclasses.replace(step, offload=mode, **chunking(offload))


def plan(cfg: DictConfig, hw: Hardware | None = None, fused_worst_case: bool = False, search: bool = True) -> dict:
    """The plan of a composed ``moe_lab.plan`` config (``hw``: its hardware, built from ``cfg.hardware`` if None):
    its metrics, in the result record's format, and the plan's own detail. ``fused_worst_case``: size the fused
    dispatcher's buffers as the code before commit 0c0883f did (for records made then); ``search``: also find the
    largest num_layers and seq_len that fit under each offload mode."""
    hw = hw or build_hardware(cfg.hardware, cfg.trainer.nproc_per_node)
    train, options = validated(cfg, hw)
    step = step_of(train, options, hw, fused_worst_case=fused_worst_case)
    memory = plan_memory(step)
    time = plan_time(step, hw)
    fpt = flops_per_token(step.cfg, step.seq_len)
    tokens = step.tokens * step.grad_accum
    tokens_per_s = tokens / time["step_s"]
    peak = hw.peak_bf16_tflops * 1e12
    ok, why = fits(step, hw)
    deepest = {}
    for mode in OFFLOAD_MODES if search else ():
        moded = offload_step(step, mode, options.offload)
        deepest[mode] = {
            "num_layers": largest(moded, hw, "num_layers", 1, max(4 * step.cfg.num_layers, 256)),
            "seq_len": largest(moded, hw, "seq_len", 128, options.model.max_position_embeddings, multiple=128),
        }
    memory_detail = memory.gib() | {"allocator_slack_gib": ALLOCATOR_SLACK * memory.peak / GIB}
    metrics = {
        "s_per_step": time["step_s"],
        "tokens_per_s_per_gpu": tokens_per_s,
        "tokens_per_step_per_gpu": tokens,
        "mfu": tokens_per_s * fpt["shared"] / peak,
        "mfu_executed": tokens_per_s * fpt["executed"] / peak,
        "flops_per_token": fpt["shared"],
        "peak_gpu_mem_gib": memory.peak / GIB,
        "peak_host_rss_gib": (memory.host_total + HOST_PROCESS) / GIB,
        "trace_breakdown": {"source": "plan", "steps": 1, "step_s": time["step_s"], "seconds": time["seconds"], "other_names": {}},
    }
    detail = {
        "hardware": hw.to_dict(),
        "mesh": {"world": step.mesh.world, "nodes": step.mesh.nodes, "gpus_per_node": step.mesh.gpus_per_node,
                 "dp_shard": step.mesh.world, "ep": step.mesh.ep, "expert_shard": step.mesh.expert_shard,
                 "ep_across_nodes": step.mesh.ep_across_nodes},  # fmt: skip
        "fits": ok,
        "fits_why": why,
        "memory": memory_detail,
        "memory_phases_gib": memory.phases,
        "communication_s": time["communication_s"],
        "exposed_communication_s": time["exposed_communication_s"],
        "exposed_communication_fraction": time["exposed_fraction"],
        "largest_fitting": deepest,
        "params_per_gpu": step.shapes.local_params(step.mesh),
    }
    return {"metrics": metrics, "plan": detail}
