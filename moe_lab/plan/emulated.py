"""What an emulated rank (``parallel.emulate``) cannot measure, the wire, from the planner: the plan of the same
point on the emulated layout's real mesh gives each collective category's exposed time, which the record adds to
the measured step beside it, each labelled.

The emulated step's own trace has its collectives at zero: their stand-in copies move nothing on a wire, so the
breakdown keeps what they took apart (``emulated_collectives_s``) and says so.
"""

from __future__ import annotations

import logging

import yaml
from omegaconf import DictConfig, OmegaConf

from moe_lab.config import ConfigError
from moe_lab.metrics.trace import COMMUNICATION
from moe_lab.runtime.paths import CONF_DIR

log = logging.getLogger("moe_lab")


def planned_plan(cfg: DictConfig) -> dict:
    """The planner's plan of ``cfg``'s point on the emulated layout's mesh (``parallel.emulate_nodes`` nodes of
    ``trainer.nproc_per_node`` GPUs of profile ``parallel.emulate_hardware``), as ``python -m moe_lab.plan`` gives
    it for the same point without ``parallel.emulate``."""
    from moe_lab.plan import config as plan_config
    from moe_lab.plan.planner import build_hardware, plan

    plan_config.register()
    p = cfg.parallel
    hardware = yaml.safe_load((CONF_DIR / "hardware" / f"{p.emulate_hardware}.yaml").read_text())
    hardware |= {"nodes": p.emulate_nodes, "gpus_per_node": cfg.trainer.nproc_per_node}
    point = OmegaConf.to_container(cfg, resolve=True)
    point["parallel"]["emulate"] = False
    point["trainer"] |= {"device": "auto", "precision": "bf16"}  # the planner predicts bf16 GPU runs
    planned = OmegaConf.create({**point, "hardware": hardware})
    return plan(planned, build_hardware(planned.hardware, cfg.trainer.nproc_per_node), search=False)


def emulated_metrics(cfg: DictConfig, metrics: dict) -> dict:
    """The emulated point's measured compute step, the planned exposed communication and their sum (and the plan's
    own step and memory beside them), each labelled; the trace breakdown with its collectives at zero."""
    out = {"s_per_step_measured": metrics.get("s_per_step")}
    breakdown = metrics.get("trace_breakdown")
    if breakdown and "seconds" in breakdown:
        seconds = breakdown["seconds"]
        out["trace_breakdown"] = {
            **breakdown,
            "seconds": {**seconds, **dict.fromkeys(COMMUNICATION, 0.0)},
            "emulated_collectives_s": {c: seconds.get(c, 0.0) for c in COMMUNICATION},
            "note": "emulated rank: collectives at zero (no wire; their stand-in copies' time is in "
            "emulated_collectives_s, outside seconds); the wire is metrics.planned_exposed_comm_s",
        }
    try:
        planned = planned_plan(cfg)
    except ConfigError as e:  # a planner that cannot plan this point leaves the measurement standing
        log.warning("no planned communication for this emulated point: %s", e)
        return out | {"planned_error": str(e)}
    exposed = planned["plan"]["exposed_communication_s"]
    wire = sum(exposed.values())
    measured = metrics.get("s_per_step")
    tokens = metrics.get("tokens_per_step_per_gpu")
    out |= {
        "planned_exposed_comm_s": wire,
        "planned_exposed_comm_by_category_s": exposed,
        "planned_hardware": cfg.parallel.emulate_hardware,
        "planned_s_per_step": planned["metrics"]["s_per_step"],
        "planned_compute_s": planned["metrics"]["s_per_step"] - wire,
        "planned_peak_gpu_mem_gib": planned["metrics"]["peak_gpu_mem_gib"],
        "s_per_step_emulated_total": measured + wire if measured else None,
        "tokens_per_s_per_gpu_emulated_total": tokens / (measured + wire) if measured and tokens else None,
    }
    return out
