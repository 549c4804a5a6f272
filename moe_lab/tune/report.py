"""A tune's report from its directory (``moe_lab.results.tune.load_tune``): the candidates' table (planned and
measured step, tokens/s/GPU, peak memory, the planner's error), the plot (tokens/s/GPU against peak memory: every
fitting point planned, their frontier, the candidates planned and measured) and the winner as one
``python -m moe_lab.train`` line."""

from __future__ import annotations

import math
import shlex
from pathlib import Path

import pandas as pd

from moe_lab.results.table import pareto_front
from moe_lab.results.tune import PLANS, load_tune, read_tune

PLOT = "tune.png"
REPORT = "report.md"
NO_OVERRIDES = "the command's own settings"  # the point every axis fixed on the command line leaves


def _number(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)) or value is pd.NA:
        return "-"
    return format(value, fmt)


def named_point(point: str, code: bool = True) -> str:
    """A point as the report names it: its overrides (as code), or the command's own settings where it has none."""
    if not point:
        return NO_OVERRIDES
    return f"`{point}`" if code else point


def candidates_table(df: pd.DataFrame, measuring: bool = False) -> pd.DataFrame:
    """The candidates' rows; a candidate with no record yet is "not measured" where the tune measures (``measuring``,
    or any record), else "planned"."""
    rows = df[df["candidate"].notna()].sort_values("candidate")
    measured = measuring or "measured_status" in rows.columns
    get = lambda row, key: row[key] if key in row.index else None
    table = pd.DataFrame(
        {
            "#": rows["candidate"].astype(int),
            "planned rank": rows["rank"].astype(int),
            "overrides": [named_point(p, code=False) for p in rows["point"]],
            "planned s/step": [_number(v, ".3f") for v in rows["planned_s_per_step"]],
            "measured s/step": [_number(get(r, "measured_s_per_step"), ".3f") for _, r in rows.iterrows()],
            "step error": [_number(get(r, "step_error"), "+.1%") for _, r in rows.iterrows()],
            "compute error": [_number(get(r, "compute_error"), "+.1%") for _, r in rows.iterrows()],
            "planned tokens/s/GPU": [_number(v, ",.0f") for v in rows["planned_tokens_per_s_per_gpu"]],
            "measured tokens/s/GPU": [
                _number(get(r, "measured_tokens_per_s_per_gpu"), ",.0f") for _, r in rows.iterrows()
            ],
            "planned peak GiB": [_number(v, ".1f") for v in rows["planned_peak_gpu_mem_gib"]],
            "measured peak GiB": [_number(get(r, "measured_peak_gpu_mem_gib"), ".1f") for _, r in rows.iterrows()],
            "memory error": [_number(get(r, "memory_error"), "+.1%") for _, r in rows.iterrows()],
            "status": [
                (get(r, "measured_status") or ("not measured" if measured else "planned"))
                + ("" if pd.isna(r["replaces"]) else f", in place of #{int(r['replaces'])}")
                for _, r in rows.iterrows()
            ],
        }
    )
    return table


def markdown(table: pd.DataFrame) -> str:
    rows = [list(table.columns)] + table.astype(str).values.tolist()
    lines = ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join([lines[0], "|" + "---|" * len(table.columns), *lines[1:]])


def winner(df: pd.DataFrame) -> tuple[pd.Series | None, str]:
    """The fastest measured candidate (ok), else the best planned point where none was measured; and by which.
    None where candidates were measured and none ran to the end (the plan was refuted there: a planned point in
    its place would be a guess), with what they ended as."""
    if "measured_status" in df.columns:
        ok = df[(df["measured_status"] == "ok") & df["measured_tokens_per_s_per_gpu"].notna()]
        if not ok.empty:
            return ok.loc[ok["measured_tokens_per_s_per_gpu"].astype(float).idxmax()], "measured"
        if statuses := df["measured_status"].dropna().value_counts().to_dict():
            ended = ", ".join(f"{status} {count}" for status, count in sorted(statuses.items()))
            return None, f"none of the {sum(statuses.values())} candidates measured ran to the end ({ended})"
    fitting = df[df["rank"].notna()].sort_values("rank")
    return fitting.iloc[0], "planned"


def order_note(df: pd.DataFrame) -> str | None:
    """Whether the measured order of the candidates agrees with the planned one, and where it does not."""
    if "measured_status" not in df.columns:
        return None
    ok = df[(df["measured_status"] == "ok") & df["measured_tokens_per_s_per_gpu"].notna()]
    if len(ok) < 2:
        return None
    planned = list(ok.sort_values("candidate")["candidate"].astype(int))
    measured = list(ok.sort_values("measured_tokens_per_s_per_gpu", ascending=False)["candidate"].astype(int))
    named = lambda order: " > ".join(f"#{c}" for c in order)
    if planned == measured:
        return f"measured order agrees with the planned order ({named(planned)})"
    return f"measured order {named(measured)} differs from the planned {named(planned)}"


def passed_over_lines(passed: list[dict]) -> list[str]:
    """The points this machine could not measure, one line per reason: their planned ranks and the first of them."""
    by_why: dict[str, list[dict]] = {}
    for row in passed:
        by_why.setdefault(row["why"], []).append(row)
    lines = []
    for why, rows in by_why.items():
        first, ranks = rows[0], spans([row["rank"] for row in rows])
        if len(rows) == 1:
            named = f"planned rank {ranks}, {named_point(first['point'])}"
        else:
            named = f"planned ranks {ranks} ({len(rows)} points; the first, {named_point(first['point'])})"
        lines += [f"Not measured here: {named}: {why}.", ""]
    return lines


def spans(numbers: list[int]) -> str:
    """``[1, 2, 3, 5, 7, 8]`` as ``1-3, 5, 7-8``."""
    out, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(str(n) if n == start else f"{start}-{n}")
            start = None
    return ", ".join(out)


def train_line(tune: dict, point: str) -> str:
    """The winner as a training command: on several nodes under ``srun`` with the planned mesh (one task per GPU;
    moe_lab.train reads its ranks from SLURM's variables), else as the job that starts its own ranks."""
    line = ["python", "-m", "moe_lab.train", *tune["train_overrides"], *point.split()]
    hw = tune["hardware"]
    if hw["nodes"] > 1:
        per_node = hw["gpus_per_node"]
        line = ["srun", f"--nodes={hw['nodes']}", f"--ntasks-per-node={per_node}", f"--gpus-per-node={per_node}", *line]
    return shlex.join(line)


def figure(df: pd.DataFrame, tune: dict):
    """Tokens/s/GPU against peak memory: every point planned (those that do not fit apart), the fitting frontier,
    the usable memory, the candidates planned and, measured, beside them."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    ok = df[df["status"] == "ok"]
    fitting, over = ok[ok["fits"].astype(bool)], ok[~ok["fits"].astype(bool)]
    ax.scatter(
        over["planned_peak_gpu_mem_gib"],
        over["planned_tokens_per_s_per_gpu"],
        s=8,
        c="#ccc",
        marker="x",
        label=f"planned, does not fit ({len(over)})",
    )
    ax.scatter(
        fitting["planned_peak_gpu_mem_gib"],
        fitting["planned_tokens_per_s_per_gpu"],
        s=10,
        c="#7aa6c2",
        label=f"planned, fits ({len(fitting)})",
    )
    front = pareto_front(fitting, "planned_peak_gpu_mem_gib", "planned_tokens_per_s_per_gpu")
    ax.step(
        front["planned_peak_gpu_mem_gib"],
        front["planned_tokens_per_s_per_gpu"],
        where="post",
        c="#1f5f8b",
        lw=1.2,
        label="fitting frontier (planned)",
    )
    usable = tune["hardware"]["usable_gib"]
    ax.axvline(usable, c="#b22", ls="--", lw=1, label=f"usable {usable:.0f} GiB")
    cands = df[df["candidate"].notna()]
    for _, row in cands.iterrows():
        x, y = row["planned_peak_gpu_mem_gib"], row["planned_tokens_per_s_per_gpu"]
        ax.scatter([x], [y], s=60, facecolors="none", edgecolors="#1f5f8b")
        ax.annotate(f"#{int(row['candidate'])}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        mx, my = row.get("measured_peak_gpu_mem_gib"), row.get("measured_tokens_per_s_per_gpu")
        if mx is not None and my is not None and not pd.isna(mx) and not pd.isna(my):
            ax.scatter([mx], [my], s=60, c="#e07b00", marker="D")
            ax.plot([x, mx], [y, my], c="#e07b00", lw=0.8)
    measured = [c for c in ("measured_tokens_per_s_per_gpu", "measured_peak_gpu_mem_gib") if c in cands.columns]
    if len(measured) == 2 and cands[measured].notna().all(axis=1).any():
        ax.scatter([], [], s=60, c="#e07b00", marker="D", label="candidate measured (line: from its plan)")
    ax.set_xlabel("peak GPU memory, GiB")
    ax.set_ylabel("tokens/s/GPU")
    ax.set_title(tune["title"], fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot(df: pd.DataFrame, tune: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = figure(df, tune)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def report(tune_dir: Path) -> tuple[str, pd.Series | None]:
    """``report.md`` and ``tune.png`` written into the tune's directory; returns the report's text and the winner
    (None: none named, ``winner``)."""
    tune = read_tune(tune_dir)
    df = load_tune(tune_dir)
    counts = df["status"].value_counts().to_dict()
    fitting = int(df["rank"].notna().sum())
    lines = [
        f"# {tune['title']}",
        "",
        f"`{tune['command']}`",
        "",
        f"{len(df)} points planned on {tune['hardware']['describe']}: {fitting} fit, "
        f"{counts.get('ok', 0) - fitting} do not, {counts.get('invalid', 0)} invalid, {counts.get('error', 0)} failed "
        f"to plan ({tune['plan_seconds']:.0f} s). {tune['measure_note']}",
        "",
    ]
    if failed := counts.get("error", 0):  # a planner failure is a bug to report, not a point that does not fit
        reasons = df.loc[df["status"] == "error", "why"].value_counts()
        lines += [
            f"The planner failed on {failed} points; the most frequent reason ({reasons.iloc[0]} of them): "
            f"`{reasons.index[0]}` (every point's in {PLANS}, column `why`).",
            "",
        ]
    best = None
    if fitting:
        measuring = tune.get("measured") is not None or any("run_dir" in c for c in tune["candidates"])
        lines += [markdown(candidates_table(df, measuring)), ""]
        if note := order_note(df):
            lines += [note + ".", ""]
        lines += passed_over_lines(tune.get("passed_over", []))
        best, by = winner(df)
        if best is None:
            lines += [f"No winner: {by}; each one's record is under measured/.", ""]
        else:
            winning = f"Winner ({by}): {named_point(best['point'])}"
            lines += [winning, "", "```bash", train_line(tune, best["point"]), "```", ""]
        plot(df, tune, tune_dir / PLOT)
        lines += [f"![tokens/s/GPU against peak memory]({PLOT})", ""]
    text = "\n".join(lines)
    (tune_dir / REPORT).write_text(text)
    return text, best
