"""``python -m moe_lab.plan``: predict a training configuration's memory and step time per GPU without a GPU.

Takes what ``python -m moe_lab.train`` takes (groups, presets, keys) plus the ``hardware`` group (h200, h100, b200,
b300, or ``hardware=<profile.yaml>`` written by ``python -m moe_lab.plan.calibrate``) and the mesh it runs on
(``hardware.nodes``, ``hardware.gpus_per_node``), validates it as train does (a layout that cannot run fails naming
its key), prints the plan and writes it as a result record (``result.json``, ``kind: plan``; its path printed
last) that ``moe_lab.results.load`` and the notebook read like a run's. The exit status is 0 for every plan made, one
that does not fit its GPUs included (``fits: false`` in the plan, its reason printed); 1 for a config train would
refuse:

    python -m moe_lab.plan model=qwen3_30b model.num_layers=4 +experiment=grid_30b dispatcher=fused ac=selective
    python -m moe_lab.plan +experiment=reference_235b hardware=b300 hardware.nodes=4 hardware.gpus_per_node=8
    python -m moe_lab.plan -m +experiment=grid_30b ac=full,selective dispatcher=torch,fused   # one record per point
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from moe_lab.config import ConfigError, register_help
from moe_lab.config.schema import GROUPS
from moe_lab.config.validate import check_command_line
from moe_lab.plan import config as plan_config
from moe_lab.plan.config import DEFAULT_HARDWARE, PlanConfig
from moe_lab.plan.hardware import profile_path_overrides
from moe_lab.plan.planner import TIE, build_hardware, plan
from moe_lab.results.record import RESULT, Record, git_state, job_meta
from moe_lab.runtime.paths import CONF_DIR

log = logging.getLogger("moe_lab.plan")
plan_config.register()

USAGE = """moe_lab.plan: a configuration's memory and step time per GPU, predicted without a GPU, recorded as result.json.

  python -m moe_lab.plan [group=option ...] [key=value ...]        one plan (what moe_lab.train takes, plus hardware)
  python -m moe_lab.plan +experiment=reference_235b hardware=b300 hardware.nodes=4 hardware.gpus_per_node=8
  python -m moe_lab.plan -m +experiment=grid_30b ac=full,selective dispatcher=torch,fused   one record per point
  python -m moe_lab.plan hardware=<profile.yaml>                   a profile written by python -m moe_lab.plan.calibrate"""
HARDWARE = "the GPUs planned for and their mesh (hardware.nodes, hardware.gpus_per_node)"


def run(cfg: DictConfig, run_dir: Path, meta: dict, multirun: bool) -> dict:
    """One point: its record, ok or invalid (a config train would refuse, with the key it names)."""
    record = Record.plan(meta, cfg, datetime.now(UTC).isoformat(timespec="seconds"))
    try:
        if cfg.parallel.emulate:  # its keys describe a layout the planner takes from hardware.*
            raise ConfigError(
                "parallel.emulate",
                "the planner plans the whole layout, not one emulated rank of it: leave it out and give the layout "
                "as hardware=<profile> hardware.nodes=N (parallel.emulate_hardware and emulate_nodes are not read)",
            )
        hw = build_hardware(cfg.hardware, cfg.trainer.nproc_per_node)
        record["world_size"] = hw.gpus
        record["environment"] = {
            "device": "plan",
            "gpu": hw.name,
            "world_size": hw.gpus,
            "nodes": hw.nodes,
            **git_state(),
        }
        result = plan(cfg, hw)
    except ConfigError as e:
        record = record.invalid(e).write(run_dir)
        if not multirun:
            sys.exit(f"invalid config: {e} (recorded in {run_dir / RESULT})")
        log.error("invalid config, point recorded in %s: %s", run_dir / RESULT, e)
        return record
    record = record.ok(result["metrics"], plan=result["plan"]).write(run_dir)
    log.info("\n%s\nrecorded in %s", summary(record), run_dir / RESULT)
    return record


def summary(record: dict) -> str:
    m, p = record["metrics"], record["plan"]
    mesh, memory = p["mesh"], p["memory"]
    lines = [
        f"plan: {mesh['world']} x {p['hardware']['name']} ({mesh['nodes']} node(s) x {mesh['gpus_per_node']}), "
        f"{mesh['dp_replicate']} replica(s) x dp_shard {mesh['dp_shard']}, "
        f"ep {mesh['ep']}{' (across nodes)' if mesh['ep_across_nodes'] else ''}, "
        f"{p['params_per_gpu'] / 1e9:.2f} B parameters per GPU",
        f"step: {m['s_per_step']:.3f} s, {m['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, MFU {100 * m['mfu']:.1f} % "
        f"(executed {100 * m['mfu_executed']:.1f} %); communication exposed {100 * p['exposed_communication_fraction']:.0f} %",
        "  " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in m["trace_breakdown"]["seconds"].items() if v),
        f"memory: peak {memory['peak_gib']:.1f} GiB allocated at {memory['peak_phase']} ({p['fits_why'] if p['fits'] else 'does not fit: ' + p['fits_why']})",
        "  "
        + ", ".join(f"{k} {v:.1f}" for k, v in memory["by_category_gib"].items())
        + "".join(f", {k} {v:.1f} (outside the allocator)" for k, v in memory["outside_allocator_gib"].items() if v)
        + f", allocator slack {memory['allocator_slack_gib']:.1f} GiB",
        f"host: {m['peak_host_rss_gib']:.1f} GiB per rank"
        + "".join(f", {k} {v:.1f}" for k, v in memory["host_gib"].items()),
        "largest that fits: "
        + "; ".join(
            f"offload={mode}: num_layers {at_least(fit, p, 'num_layers')}, seq_len {at_least(fit, p, 'seq_len')}"
            for mode, fit in p["largest_fitting"].items()
        ),
    ]
    fastest = p.get("fastest_fitting")
    if fastest:
        lines.append(
            f"fastest that fits here: {fastest['overrides']} ({fastest['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, "
            f"{fastest['peak_gpu_mem_gib']:.1f} GiB; of settings within {TIE:.0%} of the fastest, the least memory)"
        )
    elif p.get("largest_fitting_limits") is not None:  # searched, and nothing fits
        lines.append("fastest that fits here: none (no AC mode, keep set, save mode or activation offload fits)")
    return "\n".join(lines)


def at_least(fit: dict, plan: dict, field: str) -> str:
    """A largest fit as printed: ">= N (the search's limit)" where the search stopped at its limit, not at memory."""
    value, limit = fit[field], (plan.get("largest_fitting_limits") or {}).get(field)
    if value is None:
        return "none"
    return f">= {value} (the search's limit)" if limit is not None and value >= limit else str(value)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="plan")
def main(cfg: DictConfig) -> dict:
    hc = HydraConfig.get()
    return run(cfg, Path(hc.runtime.output_dir), job_meta(hc), multirun=hc.mode == RunMode.MULTIRUN)


if __name__ == "__main__":
    sys.argv = profile_path_overrides(sys.argv)
    if "--help" in sys.argv:
        sys.argv.append(register_help(USAGE, GROUPS | {"hardware": HARDWARE}, {"hardware": DEFAULT_HARDWARE}))
    try:  # a mistyped key or option gets moe_lab's message before Hydra's
        check_command_line(sys.argv, PlanConfig)
    except ConfigError as e:
        sys.exit(f"invalid config: {e}")
    main()
