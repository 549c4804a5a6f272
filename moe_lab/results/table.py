"""Sweep results as a table: ``load(sweep_dir_or_glob)`` -> one pandas row per point.

Columns: ``run_dir``, ``status``, ``error_type``, ``error_message``, then the axes: one column per group choice
(``model``, ``dispatcher``, ``ac``, ..., and ``experiment``: the preset, such as ``grid_30b`` or
``grid_30b/two_gpu``), one per other overridden key (``parallel.ep``, ``model.routing_skew``: its resolved value,
typed), and FSDP2's layout whether overridden or not (``parallel.dp_replicate``, ``parallel.reshard_after_forward``:
``layout_columns``); then ``overrides``, environment fields as ``env.<key>``, an emulated point's layout (``emulated``,
``emulated.<key>``: ``emulated_columns``; its planned communication per category as ``planned_comm.<category>``),
the scalar metrics, the trace breakdown as
``time.<category>`` (seconds per step) and ``time.step_s``. Per-step lists (losses) stay in ``metrics.jsonl``:
``step_rows`` reads them (train and eval loss, imbalance by step), ``layer_load`` the run's expert load per layer.
"""

from __future__ import annotations

import glob
import json
import math
import re
import warnings
from pathlib import Path

import pandas as pd

from moe_lab.results.record import METRICS, REPLACED, RESULT


def result_files(sweep_dir_or_glob: str | Path, name: str = RESULT) -> list[Path]:
    """Every result.json (or file ``name``) under a directory (any depth), or every one a glob pattern names (a
    pattern may name run directories or result files)."""
    pattern = str(sweep_dir_or_glob)
    if Path(pattern).is_dir():
        return sorted(Path(pattern).rglob(name), key=_natural)
    files = set()
    for match in map(Path, glob.glob(pattern, recursive=True)):
        files.update(match.rglob(name) if match.is_dir() else [match] if match.name == name else [])
    return sorted(files, key=_natural)


def unrecorded_runs(sweep_dir_or_glob: str | Path) -> list[Path]:
    """Run directories that trained (a metrics.jsonl) but hold no result.json: a job killed outright, or running."""
    return [m.parent for m in result_files(sweep_dir_or_glob, METRICS) if not (m.parent / RESULT).exists()]


def _natural(path: Path) -> list:
    # Sweep points 0, 1, ..., 10 in job order rather than 0, 1, 10, 2.
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", str(path))]


def _lookup(config: dict, dotted: str):
    for key in dotted.split("."):
        if not isinstance(config, dict) or key not in config:
            return None
        config = config[key]
    return config


def flatten(record: dict, run_dir: Path) -> dict:
    error = record.get("error") or {}
    row = {
        "run_dir": str(run_dir),
        "status": record.get("status"),
        "error_type": error.get("type"),
        "error_message": error.get("message"),
    }
    choices = record.get("choices") or {}
    row.update(choices)
    for override in record.get("overrides") or []:
        key, _, value = override.lstrip("+~").partition("=")
        if key not in choices and not key.startswith("hydra."):
            resolved = _lookup(record.get("config") or {}, key)
            row[key] = value if resolved is None else resolved
    if record.get("config"):
        row.update(layout_columns(record["config"]))
    row["overrides"] = " ".join(record.get("overrides") or [])
    row.update({f"env.{k}": v for k, v in (record.get("environment") or {}).items()})
    if emulated := record.get("emulated"):
        row.update(emulated_columns(emulated))
    if record.get("kind") == "plan":  # a plan's row says so, and whether it fits (its s/step holds either way)
        plan = record.get("plan") or {}
        row.update({"kind": "plan", "plan.fits": plan.get("fits"), "plan.fits_why": plan.get("fits_why")})
    metrics = dict(record.get("metrics") or {})
    row.update({f"planned_comm.{k}": v for k, v in (metrics.get("planned_exposed_comm_by_category_s") or {}).items()})
    trace = metrics.pop("trace_breakdown", None) or {}
    row.update({k: v for k, v in metrics.items() if not isinstance(v, (list, dict))})
    row.update({f"time.{k}": v for k, v in (trace.get("seconds") or {}).items()})
    if "step_s" in trace:
        row["time.step_s"] = trace["step_s"]
    return row


def layout_columns(config: dict) -> dict:
    """FSDP2's layout, which every point has, overridden or not (so a sweep over presets shows it where it varies):
    ``parallel.dp_replicate``, the HSDP replicas (1 in records from before the key), and
    ``parallel.reshard_after_forward`` (in records from before it, not ``parallel.keep_unsharded``, its old name)."""
    p = config.get("parallel") or {}
    return {
        "parallel.dp_replicate": p.get("dp_replicate", 1),
        "parallel.reshard_after_forward": p.get("reshard_after_forward", not p.get("keep_unsharded", False)),
    }


def emulated_columns(emulated: dict) -> dict:
    """An emulated point (``parallel.emulate``): ``emulated`` names the rank and layout it stood for, and
    ``emulated.<key>`` holds each of its fields (``emulated.world``, ``emulated.mesh.ep``, ...)."""
    mesh = emulated.get("mesh") or {}
    replicas = mesh.get("dp_replicate", 1)
    layout = f"{mesh.get('nodes')} x {mesh.get('gpus_per_node')}{f', {replicas} replicas' if replicas > 1 else ''}"
    layout += f", ep {mesh.get('ep')}"
    label = f"rank {emulated.get('rank')} of {emulated.get('world')} ({layout})"
    columns = {"emulated": label}
    columns.update({f"emulated.{k}": v for k, v in emulated.items() if k not in ("mesh", "note")})
    columns.update({f"emulated.mesh.{k}": v for k, v in mesh.items()})
    return columns


def _row(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
    except (OSError, ValueError) as e:
        warnings.warn(f"unreadable record {path}: {e}", stacklevel=3)
        record = {
            "status": "unreadable",
            "error": {"type": type(e).__name__, "message": f"{path}: {e}"},
            "overrides": [],
        }
    return flatten(record, path.parent)


def load(sweep_dir_or_glob: str | Path) -> pd.DataFrame:
    """One row per result.json found. A record that cannot be read is a row of status ``unreadable`` naming its
    file (with a warning), so one damaged file does not hide a sweep; a run directory that trained but holds no
    record (killed outright, or still running) is named in a warning; a directory (or a pattern) with no records
    warns (a sweep not started yet), a path that is neither raises ``FileNotFoundError``."""
    if not any(c in str(sweep_dir_or_glob) for c in "*?[") and not Path(sweep_dir_or_glob).exists():
        raise FileNotFoundError(f"no such sweep or run directory: {sweep_dir_or_glob}")
    paths = result_files(sweep_dir_or_glob)
    if not paths:
        warnings.warn(f"no {RESULT} under {sweep_dir_or_glob}", stacklevel=2)
    if unrecorded := unrecorded_runs(sweep_dir_or_glob):
        named = ", ".join(map(str, unrecorded[:5])) + (
            f" and {len(unrecorded) - 5} more" if len(unrecorded) > 5 else ""
        )
        replaced = sum((d / REPLACED).exists() for d in unrecorded)
        kept = f"; {replaced} of them keep the record their re-run replaced as {REPLACED}" if replaced else ""
        warnings.warn(
            f"{len(unrecorded)} run director{'y' if len(unrecorded) == 1 else 'ies'} under {sweep_dir_or_glob} trained "
            f"but hold no {RESULT} (killed outright, or still running; no row): {named}{kept}",
            stacklevel=2,
        )
    return load_files(paths)


def load_files(paths: list[Path]) -> pd.DataFrame:
    """``load`` of these result.json files, in this order."""
    rows = [_row(path) for path in paths]
    head = ["run_dir", "status", "error_type", "error_message"]
    df = pd.DataFrame(rows)
    if df.empty:  # no record yet: the columns every table has, so that df.status reads (as nothing)
        return pd.DataFrame(columns=head)
    # Every point's axes between error_message and overrides, also a key only later points have (pandas appends
    # a column first seen in a later row at the end): varying_axes reads the axes from there.
    axes = list(dict.fromkeys(c for row in rows for c in list(row)[len(head) : list(row).index("overrides")]))
    for axis in axes:
        # An integer key some points lack would read as floats (pandas fills the gaps with NaN): model.num_layers=4,
        # not 4.0.
        values = [row[axis] for row in rows if axis in row]
        if len(values) < len(rows) and all(isinstance(v, int) and not isinstance(v, bool) for v in values):
            df[axis] = df[axis].astype("Int64")
    return df[head + axes + [c for c in df.columns if c not in head and c not in axes]]


def pareto_front(df: pd.DataFrame, cost: str, gain: str) -> pd.DataFrame:
    """Rows no other row beats on both axes (lower ``cost``, higher ``gain``), sorted by cost."""
    rows = df.dropna(subset=[cost, gain]).sort_values([cost, gain], ascending=[True, False])
    best, keep = float("-inf"), []
    for index, gain_value in rows[gain].items():
        if gain_value > best:
            keep.append(index)
            best = gain_value
    return rows.loc[keep]


def varying_axes(df: pd.DataFrame) -> list[str]:
    """The group-choice and overridden-key columns (between ``error_message`` and ``overrides``) whose value differs
    between points: what a sweep swept."""
    columns = list(df.columns)
    axes = columns[columns.index("error_message") + 1 : columns.index("overrides")]
    return [c for c in axes if df[c].map(str).nunique() > 1]  # str: values may be lists; a missing value is "nan"


def by_axes(df: pd.DataFrame, values: list[str]) -> pd.DataFrame:
    """The median of ``values`` for each combination of the axes the points vary (the last axis as columns when
    there are several): never a median across a swept key, only across repeats of one point."""
    axes = varying_axes(df)
    if not axes:
        return df[values].median().to_frame("all points").T
    keyed = df.assign(**{a: df[a].map(str) for a in axes})  # a missing value (an axis some points lack) is one too
    table = keyed.groupby(axes)[values].median()
    return table.unstack(axes[-1]) if len(axes) > 1 else table


def point_labels(df: pd.DataFrame) -> pd.Series:
    """``ac=full optimizer=adamw``: each point named by the axes the sweep varies and it sets (a key another point
    overrides and this one leaves at its default is left out; a point that sets none is its run directory)."""
    axes = varying_axes(df)
    if not axes:
        return df["run_dir"]

    def label(row) -> str:
        named = " ".join(f"{k}={v}" for k, v in row[axes].items() if not _missing(v))
        return named or row["run_dir"]

    return df.apply(label, axis=1)


def _missing(value) -> bool:
    return value is pd.NA or (isinstance(value, float) and math.isnan(value))


def step_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Every point's ``metrics.jsonl``, one row per step: ``point`` (``point_labels``), ``step``, ``loss``,
    ``eval_loss`` (NaN where not evaluated), and at the steps with an ``expert_load`` row the mean over layers of
    its ``max_over_mean`` and ``busiest_ep_rank_share``. Points without the file add no rows (``metric_rows``: a
    last line cut short is left out, with a warning)."""
    rows = []
    for (_, point), label in zip(df.iterrows(), point_labels(df)):
        path = Path(point["run_dir"]) / METRICS
        if not path.exists():
            continue
        for step in metric_rows(path):
            load = step.get("expert_load") or {}
            rows.append(
                {
                    "point": label,
                    "step": step["step"],
                    "loss": step.get("loss"),
                    "eval_loss": step.get("eval_loss"),
                    **{
                        key: sum(load[key]) / len(load[key])
                        for key in ("max_over_mean", "busiest_ep_rank_share")
                        if key in load
                    },
                }
            )
    return pd.DataFrame(rows, columns=["point", "step", "loss", "eval_loss", "max_over_mean", "busiest_ep_rank_share"])


def metric_rows(path: Path) -> list[dict]:
    """A metrics.jsonl's rows. A last line cut short (a run killed while writing it) is left out with a warning, so
    the file reads as the run's steps so far; any other line that is no row is a ValueError naming file and line."""
    lines = Path(path).read_text().splitlines()
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            row = json.loads(line)
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(f"a JSON {type(row).__name__} without a step")
        except ValueError as e:
            if number < len(lines):
                raise ValueError(f"{path}: line {number} is no metrics row: {e}") from None
            steps = f"up to step {rows[-1]['step']}" if rows else "no step"
            warnings.warn(
                f"{path}: its last line is cut short (a run stopped while writing it): read {steps}", stacklevel=3
            )
            break
        rows.append(row)
    return rows


def layer_load(df: pd.DataFrame) -> pd.DataFrame:
    """Each point's expert load over its whole run, per layer (``result.json``'s ``metrics.expert_load``): ``point``,
    ``layer``, ``max_over_mean``, ``busiest_ep_rank_share``, ``entropy``."""
    rows = []
    for (_, point), label in zip(df.iterrows(), point_labels(df)):
        try:
            load = (json.loads((Path(point["run_dir"]) / RESULT).read_text()).get("metrics") or {}).get("expert_load")
        except (OSError, ValueError):
            load = None
        for layer, values in (
            enumerate(zip(*(load[k] for k in ("max_over_mean", "busiest_ep_rank_share", "entropy")))) if load else ()
        ):
            rows.append(
                {
                    "point": label,
                    "layer": layer,
                    **dict(zip(("max_over_mean", "busiest_ep_rank_share", "entropy"), values)),
                }
            )
    return pd.DataFrame(rows, columns=["point", "layer", "max_over_mean", "busiest_ep_rank_share", "entropy"])
