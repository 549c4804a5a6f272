"""Plans of measured points: a run's record (``result.json``) or a benchmark program's point (its command line),
planned on the hardware it ran on, beside what it measured."""

from __future__ import annotations

import json
import shlex
import statistics
import subprocess
from pathlib import Path

import yaml
from omegaconf import OmegaConf

from moe_lab.metrics.flops import HARDWARE_CONF, hardware_option
from moe_lab.optim.offload.host import HOST_RESERVE
from moe_lab.plan.config import compose
from moe_lab.plan.planner import plan

REPO = Path(__file__).resolve().parents[2]  # the checkout whose records and git history these read


def _hardware(gpu: str | None, world: int) -> list[str]:
    name = hardware_option(gpu) or "h200"
    return [f"hardware={name}", f"hardware.gpus_per_node={world}"]


def record_overrides(record: dict) -> list[str]:
    """The overrides that give a record's configuration today: its own (group choices, preset) and the hardware it
    ran on; ``plan_record`` then sets every value of its resolved config that today's config still has."""
    env = record.get("environment") or {}
    if emulated := record.get("emulated"):  # one rank of a layout (parallel.emulate): the layout's mesh
        mesh = emulated["mesh"]
        hardware = [
            f"hardware={emulated['hardware']}",
            f"hardware.nodes={mesh['nodes']}",
            f"hardware.gpus_per_node={mesh['gpus_per_node']}",
        ]
        return [o for o in record.get("overrides") or []] + hardware
    return [o for o in record.get("overrides") or []] + _hardware(env.get("gpu"), int(record.get("world_size") or 1))


def made_before(record: dict, commit: str, repo: Path = REPO) -> bool:
    """Whether the code a record names (``environment.git_commit``) lacks ``commit``; a record naming no commit
    git knows here is taken to be older."""
    made = (record.get("environment") or {}).get("git_commit")
    if not made:
        return True
    done = subprocess.run(["git", "-C", str(repo), "merge-base", "--is-ancestor", commit, made], capture_output=True)
    return done.returncode != 0


# Commits that changed what a configuration runs, each with the override that plans a record made before it as its
# code ran: the loss group (before it every token's logits at once), fused AdamW by default (before it torch's
# foreach AdamW, a larger transient on the GPU), the torch dispatcher's permutations by copies (before it by
# index_select).
LOSS_GROUP = "0661658"
ADAMW_FUSED = "8ae07e6"
PERMUTE_COPY = "ba8b861"


def as_made(record: dict, dispatcher: str | None = None) -> list[str]:
    """The overrides that plan a record (its ``dispatcher`` choice, when it has one) as its code ran."""
    overrides = ["loss=full"] if made_before(record, LOSS_GROUP) else []
    overrides += ["optimizer.fused=false"] if made_before(record, ADAMW_FUSED) else []
    if dispatcher == "torch" and made_before(record, PERMUTE_COPY):
        overrides.append("dispatcher.permute=select")
    return overrides


def plan_record(record: dict, extra: list[str] = (), search: bool = False) -> dict:
    before = as_made(record, (record.get("choices") or {}).get("dispatcher"))
    cfg = compose(record_overrides(record) + before + list(extra))
    measured = OmegaConf.create(record["config"])
    for section in ("model", "data", "trainer", "parallel", "dispatcher", "ac", "offload", "optimizer", "loss"):
        if section in measured:
            keep = {
                k: v
                for k, v in OmegaConf.to_container(measured[section]).items()
                if k in cfg[section] and k != "_target_"
            }
            cfg[section] = OmegaConf.merge(cfg[section], keep)
    return plan(cfg, search=search)


def plan_command(command: str, gpu: str, world: int = 1, extra: list[str] = ()) -> dict:
    """A benchmark program's point, given as its ``python -m moe_lab.train ...`` command line."""
    overrides = [a for a in shlex.split(command) if "=" in a and not a.startswith("hydra.")]
    return plan(compose(overrides + _hardware(gpu, world) + list(extra)))


def read(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())


def allocator_reserve(repo: Path = REPO, edge_share: float = 0.5, gpu: str = "h200") -> tuple[float, float]:
    """The caching allocator's reserved memory over its allocated peak (``peak_gpu_reserved_gib`` over
    ``peak_gpu_mem_gib``) at memory's edge: over the committed records of runs on ``gpu`` (the profile the planner's
    other terms are fitted on) whose peak reached ``edge_share`` of its memory, (the median, the largest). A run whose
    allocator retried (``gpu_alloc_retries``) reserved all it could: its ratio is a lower bound of what it would have
    reserved, and counts towards the largest only."""
    ratios, retried = [], []
    for path in sorted((repo / "experiments").glob("**/result.json")):
        record = read(path)
        m = record.get("metrics") or {}
        ran_on = hardware_option((record.get("environment") or {}).get("gpu"))
        if record.get("kind") == "plan" or not m.get("peak_gpu_reserved_gib") or ran_on != gpu:
            continue
        memory = yaml.safe_load((HARDWARE_CONF / f"{gpu}.yaml").read_text())["hbm_gib"]
        if m["peak_gpu_mem_gib"] >= edge_share * memory:
            (retried if m.get("gpu_alloc_retries") else ratios).append(
                m["peak_gpu_reserved_gib"] / m["peak_gpu_mem_gib"]
            )
    return statistics.median(ratios), max(ratios + retried)


# The published reference (prime-rl's docs/performance.md, github.com/PrimeIntellect-ai/prime-rl): Qwen3-235B-A22B SFT
# on 32 B300, FSDP 32 x EP 8, seq 16384, one packed sample per GPU, forced round-robin routing.
PUBLISHED_235B = {"torchtitan": 5.04, "torch dispatch": 4.39, "fused full AC": 4.10, "fused selective AC": 3.93}
REFERENCE_235B = ["+experiment=reference_235b", "hardware=b300", "hardware.nodes=4", "hardware.gpus_per_node=8"]
# torchtitan is no moe_lab option: its plan is moe_lab's torch dispatcher's, times torchtitan's step over moe_lab's
# measured at the same AC (selective) on the same two H200s in the same sitting.
TORCHTITAN_RATIO_RECORDS = (
    "experiments/torchtitan_baseline/records/h200_2gpu/2026-11-30_09-43.json",
    "experiments/grid_30b/records/h200_2gpu/2026-11-30_09-27/1/result.json",
)


def depth_search_plans(record: dict) -> dict[str, int]:
    """The deepest proxy the planner fits per mode for an offload depth search (``experiments/offload_depth/offload_gpu.py``'s
    record): each mode's 4-layer command planned on the record's GPU and on the host the search saw, whose available
    memory is what the planner's host check allows (its total, and in use whatever leaves that; a record without the
    total: the available memory as the allowed share of a host with nothing else in use)."""
    env = next(iter(record["environment"].values()))
    extra = as_made({"environment": env})
    host = record["environment"].get("search", env)  # the search phase's host, as it saw it
    if "host_mem_total_gib" in host:
        total = host["host_mem_total_gib"]
        in_use = (1 - HOST_RESERVE) * total - host["host_mem_available_gib"]
    else:
        total, in_use = host["host_mem_available_gib"] / (1 - HOST_RESERVE), 0.0
    extra += [f"hardware.host_memory_gib={total:.2f}", f"++hardware.host_memory_in_use_gib={in_use:.2f}"]
    out = {}
    for mode in record["search"]:
        point = next(p for p in record["points"] if p["mode"] == mode and p["num_layers"] == 4)
        out[mode] = plan_command(point["command"], env["gpu"], extra=extra)["plan"]["largest_fitting"][mode][
            "num_layers"
        ]
    return out


def torchtitan_ratio(repo: Path = REPO) -> float:
    titan_file, ours_file = (repo / p for p in TORCHTITAN_RATIO_RECORDS)
    titan = next(p for p in read(titan_file)["points"] if p["ac"] == "selective" and p["status"] == "ok")
    return titan["s_per_step"] / read(ours_file)["metrics"]["s_per_step"]


def reference_235b() -> list[dict]:
    """The published reference's rows beside the plans of the moe_lab configurations they correspond to
    (``compared``: the row the check holds to 20 %; the torch dispatcher with ac=full is shown, not compared: the
    reference names no AC mode for its torch-dispatch row)."""

    def planned(dispatcher: str, ac: str, *extra: str) -> dict:
        return plan(compose(REFERENCE_235B + [f"dispatcher={dispatcher}", f"ac={ac}", *extra]), search=False)

    rows = []
    for reference, dispatcher, ac, compared in (
        ("fused selective AC", "fused", "selective", True),
        ("fused full AC", "fused", "full", True),
        ("torch dispatch", "torch", "selective", True),
        ("torch dispatch", "torch", "full", False),
    ):
        p = planned(dispatcher, ac)
        rows.append(
            {
                "reference": reference,
                "dispatcher": dispatcher,
                "ac": ac,
                "compared": compared,
                "published_s": PUBLISHED_235B[reference],
                "planned_s": p["metrics"]["s_per_step"],
                "planned_mfu": p["metrics"]["mfu"],
                "fits": p["plan"]["fits"],
                "peak_gpu_mem_gib": p["metrics"]["peak_gpu_mem_gib"],
            }
        )
    # the ratio's moe_lab step was the torch dispatcher as it ran then: its permutations by index_select
    torch_selective = next(r for r in rows if r["dispatcher"] == "torch" and r["ac"] == "selective")
    as_measured = planned("torch", "selective", "dispatcher.permute=select")["metrics"]
    ratio = torchtitan_ratio()
    rows.append(
        {
            **torch_selective,
            "reference": "torchtitan",
            "dispatcher": f"torch (permute=select) x {ratio:.3f} (torchtitan / moe_lab, H200)",
            "published_s": PUBLISHED_235B["torchtitan"],
            "planned_s": as_measured["s_per_step"] * ratio,
            "planned_mfu": as_measured["mfu"] / ratio,
        }
    )
    return rows
