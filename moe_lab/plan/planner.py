"""A plan of one configuration: its options validated as ``moe_lab.train`` validates them, then memory (``memory``)
and step time (``step_time``) per rank on the hardware profile's mesh, and the deepest model and longest sequence
that fit under each offload mode.
"""

from __future__ import annotations

import dataclasses
from inspect import signature

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from moe_lab import config
from moe_lab.config import ConfigError, Options
from moe_lab.config.validate import check_target_node
from moe_lab.metrics.flops import flops_per_token
from moe_lab.optim.offload.host import HOST_RESERVE
from moe_lab.parallel.ac import KEEP_SETS
from moe_lab.plan.hardware import GIB, Hardware
from moe_lab.plan.memory import Memory, Step, plan_memory
from moe_lab.plan.models import MODELS, PLANNED_GROUPS, model_of, named, with_values
from moe_lab.plan.shapes import Mesh, Shapes
from moe_lab.plan.step_time import offload_pace, plan_time
from moe_lab.runtime.device import Target

OPTION_FIELD = {  # Options
    "dispatcher": "dispatcher",
    "precision": "precision",
    "ac": "ac",
    "offload": "offload",
    "optimizer": "make_optimizer",
    "loss": "loss",
}


def build_hardware(node, nproc_per_node: int = 1) -> Hardware:
    """The ``hardware`` group's option, built, its construction errors naming their key; a mesh that leaves
    ``gpus_per_node`` to the job gets the job's ``trainer.nproc_per_node``."""
    if not isinstance(node, DictConfig) or "_target_" not in node:
        raise ConfigError("hardware", "must be a hardware group option (hardware=h200|h100|b200|b300|file)")
    check_target_node("hardware", node)
    if missing := [key for key in node if OmegaConf.is_missing(node, key)]:
        raise ConfigError(
            f"hardware.{missing[0]}", "is required: set it on the command line (hardware=<profile.yaml> sets path)"
        )
    try:
        return instantiate(node).on_mesh(nproc_per_node)
    except Exception as e:
        if isinstance(e.__cause__, ConfigError):  # Hydra wraps what a constructor raises
            raise e.__cause__ from None
        raise


def planned_target(hw: Hardware) -> Target:
    """What validation checks a plan against: the profile's mesh as the job's ranks and its GPU, not this machine's;
    DeepGEMM taken as importable there, the GPU's FP8 support as its profile says (``peak_fp8_tflops``, which the
    planner's models check)."""
    return Target(
        world_size=hw.gpus,
        ranks_per_node=hw.gpus_per_node,
        device_type="cuda",
        compute_capability=None,
        deep_gemm_error=None,
    )


def train_config(cfg: DictConfig) -> DictConfig:
    """The training config the plan is of: without the ``hardware`` node, and set for a GPU whatever this machine
    has (``trainer.device=auto``; ``trainer.precision=auto`` is bf16 there)."""
    if cfg.trainer.device == "cpu":
        raise ConfigError("trainer.device", "the planner predicts GPU runs; use auto or cuda")
    train = OmegaConf.masked_copy(cfg, [k for k in cfg if k not in ("hardware", "hydra")])
    train.trainer.device = "auto"
    train.parallel.emulate = False  # an emulated point's plan is its layout's, on the hardware's mesh
    if train.trainer.precision == "fp32":
        raise ConfigError("trainer.precision", "the planner predicts bf16 runs; use auto or bf16")
    train.trainer.precision = "bf16"
    return train


def validated(cfg: DictConfig, hw: Hardware) -> tuple[DictConfig, Options]:
    train = train_config(cfg)
    return train, config.validate(train, planned_target(hw))


def step_of(train: DictConfig, options: Options, hw: Hardware) -> Step:
    """The plan's description of one rank's step: its shapes and mesh, and each built option's planner model
    (``moe_lab.plan.models``)."""
    models = {group: model_of(group, getattr(options, OPTION_FIELD[group])) for group in PLANNED_GROUPS}
    return Step(
        shapes=Shapes(options.model),
        mesh=Mesh(
            world=hw.gpus,
            gpus_per_node=hw.gpus_per_node,
            ep=train.parallel.ep,
            dp_replicate=train.parallel.dp_replicate,
        ),
        seq_len=train.data.seq_len,
        batch_size=train.data.batch_size,
        grad_accum=train.trainer.grad_accum,
        **models,
        target=planned_target(hw),
        compile=train.trainer.compile,
        grad_sync=train.parallel.grad_sync,
        reshard_after_forward=train.parallel.reshard_after_forward,
    )


HOST_PROCESS = (
    1.5 * GIB
)  # a training process's own resident memory (torch, CUDA runtime), the records' offload=none RSS
# The caching allocator's reserved memory over its allocated peak at memory's edge, over the committed H200 records
# whose peak reached half the GPU (``moe_lab.plan.records.allocator_reserve``; tests/test_plan_fit.py holds these to
# it): the median, which a plan must fit reserved, and the largest (reference_235b's emulated rank, whose allocator
# reached the GPU's memory and retried: a lower bound). A plan that fits, but not at the largest, is at the edge: the
# allocator is likely to free its cache and retry cudaMalloc inside the step, slower than planned (fused + none ran
# 14 % slower than planned at 129 GiB of 139.8: experiments/emulate/README.md).
ALLOCATOR_RESERVE = 1.022
ALLOCATOR_RESERVE_EDGE = 1.211


def usable_device_bytes(hw: Hardware) -> float:
    return (hw.hbm_gib - hw.context_gib) * GIB


def usable_host_bytes(hw: Hardware) -> float:
    """What offload's host check allows (the available memory less ``HOST_RESERVE`` of the total), shared by a node's
    ranks."""
    return (hw.host_memory_gib * (1 - HOST_RESERVE) - hw.host_memory_in_use_gib) * GIB


def reserved_bytes(memory: Memory, reserve: float = ALLOCATOR_RESERVE) -> float:
    """The device memory a step holds: its allocated peak as the caching allocator reserves it (``reserve`` times),
    and what it holds outside the allocator."""
    return reserve * memory.peak + sum(memory.outside_allocator.values())


def fits(step: Step, hw: Hardware) -> tuple[bool, str]:
    """Whether the step fits on ``hw``, and why (``at the edge: ...`` when it fits but the allocator is likely to
    retry)."""
    memory = plan_memory(step, offload_pace(step, hw))
    ranks_on_node = min(step.mesh.world, step.mesh.gpus_per_node)
    usable = usable_device_bytes(hw)
    device = reserved_bytes(memory)
    if device > usable:
        return (
            False,
            f"device: {device / GIB:.1f} GiB reserved (x{ALLOCATOR_RESERVE} allocated) > {usable / GIB:.1f} GiB usable",
        )
    host = (memory.host_total + HOST_PROCESS) * ranks_on_node
    if host > usable_host_bytes(hw):
        return False, f"host: {host / GIB:.1f} GiB per node > {usable_host_bytes(hw) / GIB:.1f} GiB usable"
    if (edge := reserved_bytes(memory, ALLOCATOR_RESERVE_EDGE)) > usable:
        return True, (
            f"at the edge: allocator retries likely ({edge / GIB:.1f} GiB at the most reserve seen at the edge, "
            f"x{ALLOCATOR_RESERVE_EDGE} allocated, > {usable / GIB:.1f} GiB usable)"
        )
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


# ac.keep sets the fastest-fitting search tries under ac=selective, from keeping all towards recomputing more.
KEEP_CHOICES = (
    KEEP_SETS,
    ("matmul", "grouped_mm", "attention", "router"),
    ("attention", "router", "dispatcher"),
    ("attention", "router"),
)


def room_settings(step: Step, train: DictConfig) -> list[dict]:
    """The settings of AC, ``ac.keep``, ``ac.offload_activations`` and ``dispatcher.save`` a step may take, each as
    the overrides that choose it: those whose options, built with them, accept the config ``train`` on the step's
    target (their own ``validate``: offload of activations with ac=selective only compiled, for one)."""
    acs = [{"ac": "none"}, {"ac": "full"}] + [{"ac": "selective", "ac.keep": list(keep)} for keep in KEEP_CHOICES]
    saves = step.dispatcher.save_modes(step) or (None,)
    out = []
    for ac in acs:
        takes_offload = "offload_activations" in signature(named("ac", ac["ac"]).option_class).parameters
        for offload in (False, True) if takes_offload else (False,):
            for save in saves:
                setting = dict(ac)
                if offload:
                    setting["ac.offload_activations"] = True
                if save is not None:
                    setting["dispatcher.save"] = save
                if accepts(with_setting(step, setting), train):
                    out.append(setting)
    return out


def accepts(step: Step, train: DictConfig) -> bool:
    """Whether the step's ac and dispatcher options accept ``train`` on its target."""
    try:
        for option in (step.ac.option, step.dispatcher.option):
            option.validate(train, step.target)
    except ConfigError:
        return False
    return True


def with_setting(step: Step, setting: dict) -> Step:
    """``step`` under a setting of ``room_settings``: the ac option it names built with its ``ac.*`` values (the
    others the class's defaults, as its yaml's), the dispatcher option with its ``dispatcher.*`` values."""

    def values(group: str) -> dict:
        return {k.removeprefix(f"{group}."): v for k, v in setting.items() if k.startswith(f"{group}.")}

    ac = named("ac", setting["ac"]).option_class(**values("ac"))
    dispatcher = with_values(step.dispatcher.option, **values("dispatcher"))
    return dataclasses.replace(step, ac=model_of("ac", ac), dispatcher=model_of("dispatcher", dispatcher))


def overrides_of(setting: dict) -> str:
    def value(v):
        return f"[{','.join(v)}]" if isinstance(v, list) else str(v).lower()

    return " ".join(f"{k}={value(v)}" for k, v in setting.items())


# Settings planned within this share of the fastest one's step count as tied: the plan's step times are good to a
# few per cent, and of tied settings the one with the most room left is the one to run (fused + none and fused +
# selective plan alike, and none, at memory's edge, measured 14 % slower: experiments/emulate/README.md).
TIE = 0.01


def fastest_fitting(step: Step, hw: Hardware, train: DictConfig) -> dict | None:
    """The fastest of ``room_settings`` that fits on ``hw`` (its overrides, tokens/s, step time, peak), or None; of
    settings within ``TIE`` of the fastest, the one with the lowest peak."""
    fitting = []
    for setting in room_settings(step, train):
        candidate = with_setting(step, setting)
        if fits(candidate, hw)[0]:
            fitting.append((plan_time(candidate, hw)["step_s"], setting, candidate))
    if not fitting:
        return None
    fastest = min(seconds for seconds, _, _ in fitting)
    tied = [
        (plan_memory(candidate, offload_pace(candidate, hw)).peak / GIB, seconds, setting, candidate)
        for seconds, setting, candidate in fitting
        if seconds <= fastest * (1 + TIE)
    ]
    peak, seconds, setting, candidate = min(tied, key=lambda t: t[:2])
    return {
        "overrides": overrides_of(setting),
        "s_per_step": seconds,
        "peak_gpu_mem_gib": peak,
        "tokens_per_s_per_gpu": candidate.tokens * candidate.grad_accum / seconds,
        "at_edge": fits(candidate, hw)[1].startswith("at the edge"),
    }


def fastest_by_depth(step: Step, hw: Hardware, train: DictConfig, depths, seq_lens) -> list[dict]:
    """``fastest_fitting`` at each depth (num_layers) and sequence length: the room a setting leaves, per shape."""
    rows = []
    for layers in depths:
        for seq in seq_lens:
            shaped = dataclasses.replace(_with(step, "num_layers", layers), seq_len=seq)
            rows.append({"num_layers": layers, "seq_len": seq, "fastest": fastest_fitting(shaped, hw, train)})
    return rows


def offload_step(step: Step, mode: str) -> Step:
    """``step`` under the offload mode named ``mode``: with the configured option where it is that mode, else with
    the mode's defaults."""
    if step.offload.name == mode:
        return step
    return dataclasses.replace(step, offload=model_of("offload", named("offload", mode).option_class()))


def offload_modes() -> list[str]:
    return [m.name for m in MODELS["offload"].values()]


def plan(cfg: DictConfig, hw: Hardware | None = None, search: bool = True) -> dict:
    """The plan of a composed ``moe_lab.plan`` config (``hw``: its hardware, built from ``cfg.hardware`` if None):
    its metrics, in the result record's format, and the plan's own detail. ``search``: also find the largest
    num_layers and seq_len that fit under each offload mode."""
    hw = hw or build_hardware(cfg.hardware, cfg.trainer.nproc_per_node)
    train, options = validated(cfg, hw)
    step = step_of(train, options, hw)
    memory = plan_memory(step, offload_pace(step, hw))
    time = plan_time(step, hw)
    fpt = flops_per_token(step.cfg, step.seq_len)
    tokens = step.tokens * step.grad_accum
    tokens_per_s = tokens / time["step_s"]
    peak = hw.peak_bf16_tflops * 1e12
    ok, why = fits(step, hw)
    deepest = {}
    # where the searches stop: a fit found there says "at least" (seq_len: the model's positions, in 128s)
    limits = {
        "num_layers": max(4 * step.cfg.num_layers, 256),
        "seq_len": options.model.max_position_embeddings // 128 * 128,
    }
    for mode in offload_modes() if search else ():
        moded = offload_step(step, mode)
        deepest[mode] = {
            "num_layers": largest(moded, hw, "num_layers", 1, limits["num_layers"]),
            "seq_len": largest(moded, hw, "seq_len", 128, limits["seq_len"], multiple=128),
        }
    memory_detail = memory.gib() | {
        "allocator_slack_gib": (ALLOCATOR_RESERVE - 1) * memory.peak / GIB,
        "reserved_gib": reserved_bytes(memory) / GIB,
    }
    fastest = fastest_fitting(step, hw, train) if search else None
    metrics = {
        "s_per_step": time["step_s"],
        "tokens_per_s_per_gpu": tokens_per_s,
        "tokens_per_step_per_gpu": tokens,
        "mfu": tokens_per_s * fpt["shared"] / peak,
        "mfu_executed": tokens_per_s * fpt["executed"] / peak,
        "flops_per_token": fpt["shared"],
        "peak_gpu_mem_gib": memory.peak / GIB,
        "peak_host_rss_gib": (memory.host_total + HOST_PROCESS) / GIB,
        "trace_breakdown": {
            "source": "plan",
            "steps": 1,
            "step_s": time["step_s"],
            "seconds": time["seconds"],
            "other_names": {},
        },
    }
    detail = {
        "hardware": hw.to_dict(),
        "mesh": {
            "world": step.mesh.world,
            "nodes": step.mesh.nodes,
            "gpus_per_node": step.mesh.gpus_per_node,
            "dp_replicate": step.mesh.dp_replicate,
            "dp_shard": step.mesh.shard,
            "ep": step.mesh.ep,
            "expert_shard": step.mesh.expert_shard,
            "ep_across_nodes": step.mesh.ep_across_nodes,
            "dense_across_nodes": step.mesh.dense_across_nodes,
            "replicate_across_nodes": step.mesh.replicate_across_nodes,
            "reshard_after_forward": step.reshard_after_forward,
        },
        "fits": ok,
        "fits_why": why,
        "at_edge": why.startswith("at the edge"),
        "memory": memory_detail,
        "memory_phases_gib": memory.phases,
        "communication_s": time["communication_s"],
        "exposed_communication_s": time["exposed_communication_s"],
        "exposed_communication_fraction": time["exposed_fraction"],
        "largest_fitting": deepest,
        "largest_fitting_limits": limits if search else None,
        "fastest_fitting": fastest,  # at this depth and sequence: the fastest AC / keep / save / activation offload
        "params_per_gpu": step.shapes.local_params(step.mesh),
    }
    return {"metrics": metrics, "plan": detail}
