"""Every point of the space planned (``moe_lab.plan.planner.plan``, the planner's own function), in a process pool
one combination of group options at a time, and the fitting ones ranked by planned tokens/s/GPU; before that, a
search for one point the planner's validation takes (``invalid_space``), so that a space of none is refused unplanned."""

from __future__ import annotations

import concurrent.futures
import math
import multiprocessing
import os
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from moe_lab.config import ConfigError
from moe_lab.metrics.progress import ConsoleProgress
from moe_lab.plan.planner import build_hardware, plan, validated
from moe_lab.tune.space import key_points, override_value

TIE = 1e-9  # plans this close (step time and peak, relative) are the same plan: one of them is measured


@dataclass
class Combination:
    """One combination of the group axes: its overrides, its composed config, and its key points."""

    groups: list[str]
    cfg: DictConfig
    keys: list[list[tuple[str, object]]]

    @property
    def size(self) -> int:
        return len(self.keys)


def point_config(cfg: DictConfig, keys: list[tuple[str, object]]) -> DictConfig:
    """``cfg`` with the key axes' values set and without the tune's own node: what the planner plans."""
    point = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "tune"])
    for key, value in keys:
        OmegaConf.update(point, key, value, merge=False)
    return point


def plan_point(cfg: DictConfig, hw) -> dict:
    """One point's planned row: ``status`` ok (fitting or not, ``why``), invalid (the key validation names) or
    error (the planner failed)."""
    try:
        result = plan(cfg, hw, search=False)
    except ConfigError as e:
        return {"status": "invalid", "fits": False, "why": str(e)}
    except Exception as e:  # a planner failure on one point is that point's row, not the tune's end
        return {"status": "error", "fits": False, "why": f"{type(e).__name__}: {e}"}
    m, p = result["metrics"], result["plan"]
    wire = sum(p["exposed_communication_s"].values())
    return {
        "status": "ok",
        "fits": p["fits"],
        "why": p["fits_why"],
        "planned_s_per_step": m["s_per_step"],
        "planned_tokens_per_s_per_gpu": m["tokens_per_s_per_gpu"],
        "planned_peak_gpu_mem_gib": m["peak_gpu_mem_gib"],
        "planned_mfu": m["mfu"],
        "planned_compute_s": m["s_per_step"] - wire,
        "planned_exposed_comm_s": wire,
        "planned_outside_allocator_gib": sum(p["memory"]["outside_allocator_gib"].values()),
        "planned_peak_host_rss_gib": m["peak_host_rss_gib"],
        "planned_device_total_gib": p["memory"]["device_total_gib"],
    }


def point_name(combination: Combination, keys: list[tuple[str, object]]) -> str:
    """A point as the overrides that choose it (``dispatcher=fused ac=full parallel.ep=8``): its group options and
    the key values other than those its options already have."""
    cfg = combination.cfg
    changed = [(k, v) for k, v in keys if _plain(OmegaConf.select(cfg, k)) != v]
    return " ".join(combination.groups + [f"{k}={override_value(v)}" for k, v in changed])


def _plain(value):
    return OmegaConf.to_container(value) if OmegaConf.is_config(value) else value


def hardware_of(cfg: DictConfig):
    return build_hardware(cfg.hardware, cfg.trainer.nproc_per_node)


def plan_combination(combination: Combination) -> list[dict]:
    cfg = combination.cfg
    hw = hardware_of(cfg)
    return [
        {"point": point_name(combination, keys), **plan_point(point_config(cfg, keys), hw)} for keys in combination.keys
    ]


def combinations(configs: list[tuple[list[str], DictConfig]], axes: dict) -> list[Combination]:
    return [Combination(groups, cfg, key_points(cfg, axes)) for groups, cfg in configs]


def workers(asked: int | None) -> int:
    return asked or min(4, os.cpu_count() or 1)


CHUNK = 32  # points a worker plans (or validates) per task: the progress moves, the pool stays busy to the end


def chunks(combos: list[Combination]) -> list[Combination]:
    """The combinations cut into tasks of at most ``CHUNK`` points each."""
    return [
        Combination(c.groups, c.cfg, c.keys[i : i + CHUNK]) for c in combos for i in range(0, max(c.size, 1), CHUNK)
    ]


def pool(processes: int) -> concurrent.futures.ProcessPoolExecutor:
    # fork: the workers start with the parent's imports (torch, the planner) instead of importing them again
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else None)
    return concurrent.futures.ProcessPoolExecutor(processes, mp_context=context)


def validation_error(cfg: DictConfig, hw) -> ConfigError | None:
    """Why the planner's validation refuses a point; None where it passes, or fails otherwise (a failure that is no
    refusal is the planner's to record as the point's error)."""
    try:
        validated(cfg, hw)
    except ConfigError as e:
        return e
    except Exception:
        return None
    return None


def any_valid(combination: Combination) -> bool:
    hw = hardware_of(combination.cfg)
    return any(validation_error(point_config(combination.cfg, keys), hw) is None for keys in combination.keys)


def invalid_space(combos: list[Combination], processes: int, progress: bool = True) -> ConfigError | None:
    """None as soon as a point of the space is valid (validation costs a fraction of a plan), else the refusal of
    the space's first point. The first key point of each combination first (a setting every point shares refuses
    these already), then the rest in a process pool, with its progress shown."""
    first = None
    for c in combos:
        error = validation_error(point_config(c.cfg, c.keys[0]), hardware_of(c.cfg))
        if error is None:
            return None
        first = first or error
    rest = chunks([Combination(c.groups, c.cfg, c.keys[1:]) for c in combos if c.size > 1])
    if not rest:
        return first
    bar = ConsoleProgress("points validated", sum(t.size for t in rest), enabled=progress, unit="points")
    with bar, pool(processes) as validating:
        futures = {validating.submit(any_valid, task): task for task in rest}
        for future in concurrent.futures.as_completed(futures):
            if future.result():
                validating.shutdown(cancel_futures=True)  # the tasks running end within a chunk's validation
                return None
            bar.advance(futures[future].size)
    return first


def plan_all(combos: list[Combination], processes: int, progress: bool = True) -> list[dict]:
    """Every point's row, in the space's order (group combinations, then key values, as the axes are listed)."""
    tasks = chunks(combos)
    bar = ConsoleProgress("points planned", sum(c.size for c in combos), enabled=progress, unit="points")
    results: list[list[dict]] = [[] for _ in tasks]
    if processes == 1 or len(tasks) == 1:
        for i, task in enumerate(tasks):
            results[i] = plan_combination(task)
            bar.advance(task.size)
    else:
        with pool(processes) as planning:
            futures = {planning.submit(plan_combination, task): i for i, task in enumerate(tasks)}
            for future in concurrent.futures.as_completed(futures):
                results[futures[future]] = future.result()
                bar.advance(tasks[futures[future]].size)
    bar.close()
    return [row for rows in results for row in rows]


def rank(rows: list[dict]) -> list[dict]:
    """The rows with ``rank`` (1 = the highest planned tokens/s/GPU among those that fit; ties by the lower peak,
    then the space's order) and ``same_plan_as`` (the rank of an earlier point with the very same plan: only the
    first of such points is a candidate). Fitting rows first, by rank; then the rest, faster first."""
    order = sorted(
        (i for i, r in enumerate(rows) if r["fits"]),
        key=lambda i: (-rows[i]["planned_tokens_per_s_per_gpu"], rows[i]["planned_peak_gpu_mem_gib"], i),
    )
    ranked = []
    for n, i in enumerate(order, start=1):
        row = dict(rows[i], rank=n, same_plan_as=None)
        for earlier in reversed(ranked):
            if not _same_plan(earlier, row):
                break
            row["same_plan_as"] = earlier["same_plan_as"] or earlier["rank"]
        ranked.append(row)
    rest = sorted(
        (dict(r, rank=None, same_plan_as=None) for r in rows if not r["fits"]),
        key=lambda r: -(r.get("planned_tokens_per_s_per_gpu") or 0),
    )
    return ranked + rest


def _same_plan(a: dict, b: dict) -> bool:
    return all(abs(a[k] - b[k]) <= TIE * abs(a[k]) for k in ("planned_s_per_step", "planned_peak_gpu_mem_gib"))


class CandidateQueue:
    """The fitting points in rank order, of each plan (points with the very same plan) the first one this machine
    can measure (``unmeasurable(row)``: why not, or None), taken one at a time; ``passed`` holds those passed over
    on the way, each with ``why``."""

    def __init__(self, ranked: list[dict], unmeasurable=lambda row: None) -> None:
        self.rows = [row for row in ranked if row["rank"] is not None]
        self.unmeasurable = unmeasurable
        self.passed: list[dict] = []
        self._why: dict[int, str | None] = {}  # rank -> why this machine cannot measure it, asked once
        self._taken: set[int] = set()  # the plans taken (the rank of each plan's first point)

    def take(self, below_gib: float = math.inf) -> dict | None:
        """The best point left of a plan not taken, planned to hold less than ``below_gib``; None when none is."""
        for row in self.rows:
            plan_of = row["same_plan_as"] or row["rank"]
            if plan_of in self._taken or row["planned_peak_gpu_mem_gib"] >= below_gib:
                continue
            if row["rank"] not in self._why:
                self._why[row["rank"]] = why = self.unmeasurable(row)
                if why:
                    self.passed.append({"rank": row["rank"], "point": row["point"], "why": why})
            if self._why[row["rank"]] is None:
                self._taken.add(plan_of)
                return row
        return None
