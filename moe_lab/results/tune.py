"""A tune's directory (``python -m moe_lab.tune``) as one table: ``load_tune(tune_dir)`` -> one pandas row per
planned point, the measured candidates' records joined to their plans.

The directory holds ``tune.json`` (the tune: its command, space, layout, candidates, what it measured and the
winner), ``plans.csv.gz`` (every point's plan, one row each: ``point`` its overrides, ``status`` ok | invalid | error,
``fits`` and ``why``, ``rank`` among the fitting, ``same_plan_as``, the ``planned_*`` metrics) and ``measured/``
(the candidates' sweep: an ordinary ``moe_lab.train -m`` sweep, ``moe_lab.results.load`` reads it as any other).
Candidates that ran out of memory are replaced in a sweep of their own: round ``n`` > 1, the replacements of round
``n - 1``'s, is ``candidates_<n>.yaml`` and ``measured_<n>/``; each candidate in ``tune.json`` names its ``run_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from moe_lab.results.record import read_result

TUNE, PLANS, MEASURED, CANDIDATES = "tune.json", "plans.csv.gz", "measured", "candidates.yaml"


def round_files(round_number: int) -> tuple[str, str]:
    """A measuring round's candidates file and sweep directory, relative to the tune's directory."""
    if round_number == 1:
        return CANDIDATES, MEASURED
    return f"candidates_{round_number}.yaml", f"{MEASURED}_{round_number}"


def run_dir_of(candidate: dict) -> str:
    """Where a candidate's record is: its own ``run_dir``, or (a tune of one round, before replacements) the job of
    the first sweep its number names."""
    return candidate.get("run_dir") or f"{MEASURED}/{candidate['candidate'] - 1}"


def read_tune(tune_dir: str | Path) -> dict:
    return json.loads((Path(tune_dir) / TUNE).read_text())


def is_tune(path: str | Path) -> bool:
    return (Path(path) / TUNE).is_file()


def measured_row(record: dict, planned: pd.Series) -> dict:
    """A candidate's measured step, tokens/s/GPU and peak against its plan. An emulated rank (``parallel.emulate``)
    measures compute only: its step is that plus the planned exposed communication (``s_per_step_emulated_total``),
    its compute error is against the plan's compute, and its peak counts the fused op's symmetric workspace, which
    the plan lists outside the allocator."""
    m = record.get("metrics") or {}
    emulated = bool(record.get("emulated"))
    step = m.get("s_per_step_emulated_total" if emulated else "s_per_step")
    tokens = m.get("tokens_per_s_per_gpu_emulated_total" if emulated else "tokens_per_s_per_gpu")
    compute = m.get("s_per_step_measured" if emulated else "s_per_step")
    peak = m.get("peak_gpu_mem_gib")
    planned_peak = planned["planned_peak_gpu_mem_gib"] + (planned["planned_outside_allocator_gib"] if emulated else 0)
    error = lambda measured, plan: measured / plan - 1 if measured and plan else None
    return {
        "measured_status": record.get("status"),
        "measured_error": (record.get("error") or {}).get("message"),
        "emulated": emulated,
        "measured_s_per_step": step,
        "measured_tokens_per_s_per_gpu": tokens,
        "measured_compute_s": compute,
        "measured_peak_gpu_mem_gib": peak,
        "step_error": error(step, planned["planned_s_per_step"]),
        "compute_error": error(compute, planned["planned_compute_s"] if emulated else planned["planned_s_per_step"]),
        "memory_error": error(peak, planned_peak),
    }


def load_tune(tune_dir: str | Path) -> pd.DataFrame:
    """Every planned point, ranked (fitting first), with ``candidate`` (1..: the order measured; a replacement's
    ``replaces``, the candidate it stands in for) and, for each measured candidate, ``measured_*``, the planner's
    errors (``step_error``, ``compute_error``, ``memory_error``: measured / planned - 1) and its ``run_dir``."""
    tune = read_tune(tune_dir)
    df = pd.read_csv(Path(tune_dir) / PLANS, dtype={"point": str})
    df["point"] = df["point"].fillna("")  # the point of no overrides (every axis fixed), which csv reads as NaN
    df["candidate"] = pd.NA
    df["replaces"] = pd.NA
    for candidate in tune.get("candidates", []):
        index = df.index[df["point"] == candidate["point"]]
        if index.empty:
            continue
        i = index[0]
        df.loc[i, "candidate"] = candidate["candidate"]
        df.loc[i, "replaces"] = candidate.get("replaces")
        run_dir = Path(tune_dir) / run_dir_of(candidate)
        if (record := read_result(run_dir)) is None:
            continue  # not measured yet, or a record being written or damaged
        for key, value in {**measured_row(record, df.loc[i]), "run_dir": str(run_dir)}.items():
            if key not in df.columns:
                df[key] = pd.Series([None] * len(df), dtype=object)
            df.at[i, key] = value
    return df
