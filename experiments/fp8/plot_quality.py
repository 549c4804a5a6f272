"""The quality part's curves: each run of a ``run.sh quality`` record (one folder per expert precision) as training
loss (a 50-step running mean), held-out loss and the busiest expert's load over the mean (averaged over layers), one
figure beside the record (``curves.png``).

    python experiments/fp8/plot_quality.py experiments/fp8/records/h200_quality/2026-12-02_05-55
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from moe_lab.results.record import read_result  # noqa: E402


def runs(record: Path) -> dict[str, pd.DataFrame]:
    """expert precision -> the run's metrics rows, by step."""
    out = {}
    for run in sorted(p for p in record.iterdir() if (p / "metrics.jsonl").is_file()):
        precision = read_result(run)["config"]["dispatcher"]["expert_precision"]
        out[precision] = pd.read_json(run / "metrics.jsonl", lines=True).set_index("step")
    if not out:
        raise SystemExit(f"{record}: no run folder with a metrics.jsonl")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path, help="a quality record folder (records/<machine>_quality/<stamp>)")
    record = parser.parse_args().record
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for precision, rows in runs(record).items():
        axes[0].plot(rows["loss"].rolling(50, min_periods=1).mean(), label=precision)
        axes[1].plot(rows["eval_loss"].dropna(), marker="o", label=precision)
        load = rows["expert_load"].dropna().map(lambda e: sum(e["max_over_mean"]) / len(e["max_over_mean"]))
        axes[2].plot(load, label=precision)
    for ax, title in zip(axes, ("training loss (50-step mean)", "held-out loss", "busiest expert / mean (layer mean)")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(record / "curves.png", dpi=100)
    print(record / "curves.png")


if __name__ == "__main__":
    main()
