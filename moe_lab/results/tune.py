"""A tune's directory (``python -m moe_lab.tune``) as one table: ``load_tune(tune_dir)`` -> one pandas row per
planned point, the measured candidates' records joined to their plans.

The directory holds ``tune.json`` (the tune: its command, space, layout, candidates, what it measured and the
winner), ``plans.csv.gz`` (every point's plan, one row each: ``point`` its overrides, ``status`` ok | invalid | error,
``fits`` and ``why``, ``rank`` among the fitting, ``same_plan_as``, the ``planned_*`` metrics) and ``measured/``
(the candidates' sweep: an ordinary ``moe_lab.train -m`` sweep, ``moe_lab.results.load`` reads it as any other).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from moe_lab.results.table import result_files

TUNE, PLANS, MEASURED, CANDIDATES = "tune.json", "plans.csv.gz", "measured", "candidates.yaml"


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


def measured_records(tune_dir: str | Path) -> list[tuple[Path, dict]]:
    out = []
    for path in result_files(Path(tune_dir) / MEASURED) if (Path(tune_dir) / MEASURED).is_dir() else []:
        try:
            out.append((path.parent, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue  # a record being written or damaged: the point is not measured yet
    return out


def load_tune(tune_dir: str | Path) -> pd.DataFrame:
    """Every planned point, ranked (fitting first), with ``candidate`` (1..K: the order measured) and, for each
    measured candidate, ``measured_*``, the planner's errors (``step_error``, ``compute_error``, ``memory_error``:
    measured / planned - 1) and its ``run_dir``."""
    tune = read_tune(tune_dir)
    df = pd.read_csv(Path(tune_dir) / PLANS, dtype={"point": str})
    df["candidate"] = pd.NA
    records = measured_records(tune_dir)
    for candidate in tune.get("candidates", []):
        index = df.index[df["point"] == candidate["point"]]
        if index.empty:
            continue
        i = index[0]
        df.loc[i, "candidate"] = candidate["candidate"]
        wanted = set(candidate["point"].split())
        for run_dir, record in records:
            if wanted <= set(record.get("overrides") or []):
                for key, value in {**measured_row(record, df.loc[i]), "run_dir": str(run_dir)}.items():
                    if key not in df.columns:
                        df[key] = pd.Series([None] * len(df), dtype=object)
                    df.at[i, key] = value
                break
    return df
