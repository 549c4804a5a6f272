"""Same model, different layout? Compare runs' loss curves step by step against the run-to-run noise of the first.

    python -m moe_lab.compare REF RUN [RUN ...]               # table of the curves and their differences
    python -m moe_lab.compare REF RUN --assert-equal          # exit 1 unless every step's value is bitwise equal
    python -m moe_lab.compare REF RUN --noise REF_REPEAT      # band: how far repeats of REF drift apart
    python -m moe_lab.compare REF RUN --noise noise.json      # band: a noise record (--write-noise makes one)
    python -m moe_lab.compare REF RUN --noise R2 R3 --noise-factor 2   # band: twice what two repeats showed
    python -m moe_lab.compare REF RUN --rtol 1e-5 --atol 0    # band: a stated envelope (added to any noise band)
    python -m moe_lab.compare SWEEP_DIR --plot out.png        # a sweep directory stands for all its points

Each argument is a run directory (``result.json`` + ``metrics.jsonl``) or a directory of them (a sweep); the first
run found is the reference. Runs are aligned by step. The band at step s is the noise band there plus
``atol + rtol * |reference|``. A noise band from repeats of the reference is, at each step, the largest difference
between any two of them (the reference included), carried forward as a running maximum: repeats drift apart as they
train, and a step at which they happen to agree again is no tighter bound than the steps before it. Without
``--noise``, a noise record ``noise.json`` in the reference's directory or its parent (the sweep) is read, if
there is one. A run's metrics.jsonl whose last line was cut short (a run killed while writing it) is read as its
steps so far, and said so.

Exit status: 0 when every run stays in its band (with no check asked: every run ran, and its differences are only
shown); 1 when a run leaves its band (or, with ``--assert-equal``, differs at all), failed, lacks steps or has no step
in common with the reference, each named with its step, difference and band; 2 when an argument is wrong or a run
cannot be read (no such directory, no result.json, a record or metrics.jsonl that is not one), in one line naming
the run and the file.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from moe_lab.results.record import METRICS, RESULT
from moe_lab.results.table import load_files, metric_rows, point_labels, result_files

NOISE_RECORD = "noise.json"


class Unreadable(Exception):
    """A run or file this comparison cannot read; its message is one line naming it (exit status 2)."""


def run_dirs(paths: list[str | Path]) -> list[Path]:
    """Each path a run directory, or a sweep directory standing for its points (in job order)."""
    found: list[Path] = []
    for path in map(Path, paths):
        if not path.is_dir():
            raise Unreadable(f"{path}: no such run directory")
        runs = [path] if (path / RESULT).exists() else [f.parent for f in result_files(path)]
        if not runs:
            raise Unreadable(f"{path}: no {RESULT} in it or under it (not a run directory, nor a sweep of them)")
        found += [r for r in runs if r not in found]
    return found


def load_runs(paths: list[str | Path]) -> pd.DataFrame:
    """The runs' records (``moe_lab.results.table``), one row each, with ``label``: what tells them apart (the axes
    they vary, else the run directory's name), unique. ``Unreadable`` names a record that is none, and a run without
    a metrics.jsonl that should have one (the reference, or a run whose record says ok)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an unreadable record is refused below, by name
        df = load_files([d / RESULT for d in run_dirs(paths)])
    for i, (run_dir, status, message) in enumerate(df[["run_dir", "status", "error_message"]].itertuples(False)):
        if status == "unreadable":
            raise Unreadable(f"{run_dir}: {message}")
        if (i == 0 or status == "ok") and not (Path(run_dir) / METRICS).is_file():
            raise Unreadable(f"{run_dir}: no {METRICS} ({Path(run_dir) / METRICS}), though its record says {status}")
    axes = list(point_labels(df)) if len(df) > 1 else list(df["run_dir"])
    names = [Path(d).name for d in df["run_dir"]]
    short = names if len(set(names)) == len(names) else list(df["run_dir"])
    labels = [name if label in ("", run_dir) else label for label, run_dir, name in zip(axes, df["run_dir"], short)]
    unique = [f"{label} ({name})" if labels.count(label) > 1 else label for label, name in zip(labels, short)]
    return df.assign(label=unique)


def curves(runs: pd.DataFrame, metric: str = "loss") -> pd.DataFrame:
    """Each run's ``metric`` by step (``metrics.jsonl``): index step, one column per run label, NaN where a run has
    no value at a step. A metrics.jsonl cut short in its last line reads as its steps so far, with a warning; one
    with another line that is no row is ``Unreadable``."""
    columns = {}
    for label, run_dir in zip(runs["label"], runs["run_dir"]):
        path = Path(run_dir) / METRICS
        try:
            rows = pd.DataFrame(metric_rows(path) if path.is_file() else [])
        except ValueError as e:  # metric_rows names the file and line
            raise Unreadable(str(e)) from None
        columns[label] = rows.set_index("step")[metric].dropna() if metric in rows else pd.Series(dtype=float)
    return pd.DataFrame(columns).sort_index()


def spread(repeats: pd.DataFrame) -> pd.Series:
    """Repeats of one run (columns), by step -> the largest difference between any two of them at each step where
    all have a value (max - min over the repeats)."""
    if repeats.shape[1] < 2:
        raise ValueError("a noise band needs the reference and at least one repeat of it")
    common = repeats.dropna()
    return common.max(axis=1) - common.min(axis=1)


def noise_from_repeats(repeats: pd.DataFrame) -> pd.Series:
    """Repeats of one run (columns), by step -> the band: their ``spread`` as a running maximum over the steps."""
    return spread(repeats).cummax().rename("noise")


def noise_record(band: pd.Series, metric: str, reference: str, repeats: list[str]) -> dict:
    return {
        "metric": metric,
        "reference": reference,
        "repeats": repeats,
        "envelope": float(band.max()),
        "band": [[int(s), float(v)] for s, v in band.items()],
    }


def read_noise(path: Path, steps: pd.Index) -> pd.Series:
    """A noise record -> its band at ``steps``: ``band`` ([step, value] pairs) where given, carried forward (and back
    to steps before its first), else the constant ``envelope``."""
    record = json.loads(Path(path).read_text())
    if record.get("band"):
        given = pd.Series({int(s): float(v) for s, v in record["band"]}).sort_index()
        return given.reindex(given.index.union(steps)).ffill().bfill().reindex(steps).rename("noise")
    if "envelope" not in record:
        raise ValueError(f"{path}: a noise record holds band ([step, value] pairs) or envelope (a number)")
    return pd.Series(float(record["envelope"]), index=steps, name="noise")


@dataclass
class Verdict:
    label: str
    ok: bool
    message: str


def check(
    table: pd.DataFrame, runs: pd.DataFrame, band: pd.Series | None, atol: float, rtol: float, exact: bool
) -> list[Verdict]:
    """Each run against the reference (``table``'s first column): its largest difference and whether it stays in
    its band (``band`` + atol + rtol * |reference|; ``exact``: bitwise equal at every step). With no check at all (no
    band, atol, rtol or ``exact``) a run that ran is ok and its differences are only described; a failed run, or one
    with no step in common with the reference, fails whatever the check."""
    checked = exact or band is not None or bool(atol) or bool(rtol)
    reference = table.columns[0]
    ref = table[reference]
    verdicts = []
    for (_, run), label in zip(runs.iloc[1:].iterrows(), table.columns[1:]):
        if run["status"] != "ok":
            verdicts.append(Verdict(label, False, f"{label}: status {run['status']} ({run['error_message']})"))
            continue
        both = ref.notna() & table[label].notna()
        missing = table.index[ref.notna() != table[label].notna()]
        diff = (table[label] - ref)[both]
        if diff.empty:
            verdicts.append(Verdict(label, False, f"{label}: no step in common with {reference}"))
            continue
        worst = diff.abs().idxmax()
        rms = math.sqrt(float((diff**2).mean()))
        if not checked:
            ok = True
            message = f"{label}: largest difference {diff[worst]:+.3e} at step {worst}; root mean square {rms:.3e}" + (
                f"; steps {list(missing)[:5]} are in one run only" if not missing.empty else ""
            )
        elif exact:
            unequal = diff.index[diff != 0]
            ok = unequal.empty and missing.empty
            first = unequal[0] if len(unequal) else None
            message = (
                f"{label}: bitwise equal to {reference} at all {len(diff)} steps"
                if ok
                else f"{label}: differs from {reference} first at step {first} by {diff[first]:+.3e}, at most "
                f"{diff[worst]:+.3e} (step {worst})"
                if first is not None
                else f"{label}: equal where both have a value, but steps {list(missing)[:5]} are in one run only"
            )
        else:
            allowed = (band.reindex(diff.index).fillna(0) if band is not None else 0) + atol + rtol * ref[both].abs()
            over = diff.index[diff.abs() > allowed]
            ok = over.empty and missing.empty
            if not over.empty:
                s = over[0]
                message = (
                    f"{label}: leaves the band first at step {s}: difference {diff[s]:+.3e}, band "
                    f"{allowed[s]:.3e} ({len(over)} of {len(diff)} steps outside; largest {diff[worst]:+.3e} at "
                    f"step {worst}, band {allowed[worst]:.3e}; root mean square {rms:.3e})"
                )
            elif not missing.empty:
                message = (
                    f"{label}: within the band where both have a value, but steps {list(missing)[:5]} are in "
                    "one run only"
                )
            else:
                message = (
                    f"{label}: within the band at all {len(diff)} steps (largest {diff[worst]:+.3e} at step "
                    f"{worst}, band {allowed[worst]:.3e}; root mean square {rms:.3e})"
                )
        verdicts.append(Verdict(label, ok, message))
    return verdicts


def difference_table(table: pd.DataFrame, band: pd.Series | None, rows: int = 12) -> pd.DataFrame:
    """A compact view: the reference's value, the noise band and each run's difference from the reference, at up to
    ``rows`` steps spread over the run (the first, the last, and each run's largest difference among them)."""
    ref = table.iloc[:, 0]
    diffs = table.iloc[:, 1:].sub(ref, axis=0)
    steps = list(table.index)
    if len(steps) > rows:
        picked = {steps[round(i * (len(steps) - 1) / (rows - 1))] for i in range(rows)}
        picked |= {diffs[c].abs().idxmax() for c in diffs if diffs[c].notna().any()}
        steps = sorted(picked)
    view = pd.DataFrame({f"{table.columns[0]} (reference)": ref}).join(diffs.add_prefix("diff "))
    if band is not None:
        view.insert(1, "noise band", band)
    return view.loc[steps].rename_axis("step")


def plot(table: pd.DataFrame, band: pd.Series | None, out: str | Path | None = None, metric: str = "loss"):
    """The curves (left) and each run's |difference| from the reference with the noise band shaded (right, log
    scale). Saved to ``out`` when given; returns the figure."""
    import matplotlib

    if out is not None:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_curve, ax_diff) = plt.subplots(1, 2, figsize=(13, 4.5))
    for i, label in enumerate(table.columns):
        ax_curve.plot(table.index, table[label], color=f"C{i % 10}", lw=1, label=label)
    ax_curve.set_xlabel("step")
    ax_curve.set_ylabel(metric)
    ax_curve.legend(fontsize=7)
    ref = table.iloc[:, 0]
    for i, label in enumerate(table.columns[1:], start=1):
        diff = (table[label] - ref).abs()
        ax_diff.plot(diff.index, diff.where(diff > 0), color=f"C{i % 10}", lw=1, label=label)
    if band is not None and (band > 0).any():
        ax_diff.fill_between(band.index, 0, band.where(band > 0), color="0.8", label="noise band of the reference")
    ax_diff.set_yscale("log")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel(f"|{metric} - reference| (0: not drawn)")
    ax_diff.set_title(f"reference: {table.columns[0]}", fontsize=9)
    handles = ax_diff.get_legend_handles_labels()[0]
    if handles:
        ax_diff.legend(fontsize=7)
    fig.tight_layout()
    if out is not None:
        fig.savefig(out, dpi=110)
    return fig


def sweep_view(runs: pd.DataFrame, metric: str = "loss") -> pd.DataFrame:
    """For a notebook: each ok point's curve against the first ok point's, with a plot; the noise band is that of the
    sweep's own repeats of it (points with the same label), if there are any. -> the per-point summary (empty where
    fewer than two points have a curve: a plan's record has no steps)."""
    ok = runs[runs["status"] == "ok"]
    base = [str(label) for label in (ok["label"] if "label" in ok else point_labels(ok))]
    labels = [f"{label} #{i}" if base.count(label) > 1 else label for i, label in enumerate(base)]
    table = curves(ok.assign(label=labels), metric).dropna(axis=1, how="all")
    if table.shape[1] < 2:
        return pd.DataFrame()
    base = [b for label, b in zip(labels, base) if label in table.columns]
    repeats = [label for label, b in zip(table.columns, base) if b == base[0]]
    band = noise_from_repeats(table[repeats]).reindex(table.index).ffill() if len(repeats) > 1 else None
    plot(table, band, metric=metric)
    diffs = table.iloc[:, 1:].sub(table.iloc[:, 0], axis=0).abs()
    summary = pd.DataFrame({"max |difference|": diffs.max(), "at step": diffs.idxmax()})
    if band is not None:
        summary["noise band there"] = [band.get(s, math.nan) for s in summary["at step"]]
    return summary.rename_axis(f"vs {table.columns[0]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_lab.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", help="run directories or sweep directories; the first run is the reference")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--assert-equal", action="store_true", help="fail unless every step is bitwise equal")
    parser.add_argument("--rtol", type=float, default=0.0, help="band: + rtol * |reference| (default 0)")
    parser.add_argument("--atol", type=float, default=0.0, help="band: + atol (default 0)")
    mode.add_argument(
        "--noise",
        nargs="+",
        action="extend",
        metavar="NOISE",
        help=f"repeats of the reference (run or sweep directories), or a noise record ({NOISE_RECORD})",
    )
    parser.add_argument(
        "--noise-factor",
        type=float,
        default=1.0,
        metavar="F",
        help="the noise band is F times the spread the repeats showed (default 1; a few repeats show "
        "less than the noise's whole range)",
    )
    parser.add_argument(
        "--write-noise", metavar="PATH", help="write the band measured from --noise repeats as a noise record"
    )
    parser.add_argument(
        "--metric", default="loss", help="the metrics.jsonl column compared (default loss; eval_loss, grad_norm, ...)"
    )
    parser.add_argument("--plot", metavar="PNG", help="draw the curves and their differences (matplotlib)")
    args = parser.parse_args(argv)
    if args.assert_equal and (args.rtol or args.atol):
        parser.error("--assert-equal checks bitwise equality: give no --rtol / --atol with it")
    for flag in ("rtol", "atol", "noise_factor"):  # a negative width would fail every run, the reference's own
        if getattr(args, flag) < 0:
            parser.error(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag):g}")
    try:
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always")
            return _compare(args, parser, notes)
    except Unreadable as e:
        print(f"{parser.prog}: {e}", file=sys.stderr)
        return 2


def _compare(args: argparse.Namespace, parser: argparse.ArgumentParser, notes: list) -> int:
    runs = load_runs(args.runs)
    if len(runs) < 2:
        parser.error(f"need two runs or more, found {len(runs)} in {' '.join(args.runs)}")
    table = curves(runs, args.metric)
    if table.empty or table.iloc[:, 0].isna().all():
        reference_dir = Path(runs["run_dir"].iloc[0])
        raise Unreadable(f"{reference_dir} (the reference): no {args.metric} in {reference_dir / METRICS}")
    band, band_from = None, None
    reference_dir = Path(runs["run_dir"].iloc[0])
    records = [p for p in (args.noise or []) if Path(p).is_file()]
    repeat_paths = [p for p in (args.noise or []) if not Path(p).is_file()]
    if repeat_paths:
        repeats = load_runs([reference_dir, *repeat_paths])
        if len(repeats) < 2:  # the reference named again is no repeat of it
            parser.error(f"--noise: {' '.join(repeat_paths)} holds no run but the reference; give repeats of it")
        repeat_curves = curves(repeats, args.metric)
        band = noise_from_repeats(repeat_curves).reindex(table.index).ffill()
        repeat_spread = spread(repeat_curves)
        # The root mean square beside each run's: a steadier measure than the largest difference, which one repeat
        # samples poorly.
        band_from = (
            f"{len(repeats) - 1} repeat(s) of the reference, their spread's root mean square "
            f"{math.sqrt(float((repeat_spread**2).mean())):.3e}"
        )
        if args.write_noise:
            Path(args.write_noise).write_text(
                json.dumps(
                    noise_record(band.dropna(), args.metric, str(reference_dir), list(repeats["run_dir"][1:])), indent=1
                )
            )
    elif args.write_noise:
        parser.error("--write-noise needs --noise with repeats of the reference")
    committed = [reference_dir / NOISE_RECORD, reference_dir.parent / NOISE_RECORD]
    if not records and band is None and not args.assert_equal:
        records = [p for p in committed if p.is_file()][:1]
    if records:
        try:
            bands = [read_noise(Path(p), table.index) for p in records]
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise Unreadable(f"noise record {', '.join(map(str, records))}: {e}") from None
        band = pd.concat(bands, axis=1).max(axis=1).rename("noise")
        band_from = f"noise record {', '.join(map(str, records))}"
    if band is not None and args.noise_factor != 1:
        band = band * args.noise_factor
        band_from += f", x {args.noise_factor:g}"

    pd.set_option("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.6g}".format)
    for note in notes:  # a metrics.jsonl read as its steps so far
        print(f"note: {note.message}")
    label = runs["label"].iloc[0]
    where = "" if label.endswith(f"({reference_dir})") else f" ({reference_dir})"  # a label made unique by it already
    print(f"reference: {label}{where}; {args.metric} by step")
    if (status := runs["status"].iloc[0]) != "ok":  # a failed reference is compared as its steps so far
        print(f"note: the reference ended {status} ({runs['error_message'].iloc[0]}): compared as far as it ran")
    print(difference_table(table, band).to_string())
    checked = args.assert_equal or band is not None or args.rtol or args.atol
    envelope = " + ".join(
        filter(
            None,
            [
                band_from and f"noise band ({band_from})",
                args.atol and f"atol {args.atol:g}",
                args.rtol and f"rtol {args.rtol:g} x |reference|",
            ],
        )
    )
    print(
        "check: "
        + (
            "bitwise equality"
            if args.assert_equal
            else f"band = {envelope}"
            if checked
            else "none (give --assert-equal, --noise, --rtol or --atol)"
        )
    )
    verdicts = check(table, runs, band, args.atol, args.rtol, args.assert_equal)
    for v in verdicts:
        print(("FAIL " if not v.ok else "ok   " if checked else "     ") + v.message)
    if args.plot:
        plot(table, band, args.plot, args.metric)
        print(f"plot: {args.plot}")
    return 0 if all(v.ok for v in verdicts) else 1


if __name__ == "__main__":
    sys.exit(main())
