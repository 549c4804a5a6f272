"""The tables of docs/performance.md, regenerated from the committed raw results.

    python benchmarks/performance_tables.py           # rewrite every generated table in docs/performance.md
    python benchmarks/performance_tables.py --check   # exit 1 if the doc's tables differ from the results

A generated table sits between ``<!-- table: NAME -->`` and ``<!-- /table -->`` in the doc; everything else in the
doc is prose. Sweep directories are read with ``moe_lab.results.load``, the same loader the notebook uses.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import pandas as pd

from moe_lab.metrics.trace import CATEGORIES
from moe_lab.results import load

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
DOC = ROOT / "docs" / "performance.md"
BLOCK = re.compile(r"(<!-- table: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def markdown(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pct(x) -> str:
    return "" if x is None or pd.isna(x) else f"{100 * x:.1f} %"


def num(x, fmt=",.0f") -> str:
    return "" if x is None or pd.isna(x) else format(x, fmt)


@functools.cache
def grid(sweep: str) -> pd.DataFrame:
    """A grid_30b sweep directory under results/, one row per point."""
    return load(RESULTS / sweep)


@functools.cache
def torchtitan(name: str) -> dict[str, dict]:
    """torchtitan's successful points in results/NAME.json by AC mode (one GPU count and seq per file)."""
    points = json.loads((RESULTS / f"{name}.json").read_text())["points"]
    return {p["ac"]: p for p in points if p["status"] == "ok"}


def grid_table(sweep: str, baseline: str) -> str:
    titan = torchtitan(baseline)
    rows = []
    for _, r in grid(sweep).iterrows():
        ok = r["status"] == "ok"
        base = titan.get(r["ac"])
        ratio = f"{r['tokens_per_s_per_gpu'] / base['tokens_per_s_per_gpu']:.2f}x" if ok and base else ""
        rows.append([r["offload"], r["dispatcher"], r["ac"], r["status"], num(r.get("s_per_step"), ".3f"),
                     num(r.get("tokens_per_s_per_gpu")), pct(r.get("mfu")), pct(r.get("mfu_executed")),
                     num(r.get("peak_gpu_mem_gib"), ".1f"), num(r.get("peak_host_rss_gib"), ".1f"), ratio])  # fmt: skip
    header = ["offload", "dispatcher", "ac", "status", "s/step", "tokens/s/GPU", "MFU", "MFU executed", "peak GPU GiB",
              "peak host GiB", "vs torchtitan (same ac)"]  # fmt: skip
    return markdown(rows, header)


def torchtitan_table(names: list[str]) -> str:
    rows = []
    for name in names:
        for ac, p in torchtitan(name).items():
            rows.append([p["gpus"], num(p["seq_len"]), ac, num(p["s_per_step"], ".3f"), num(p["tokens_per_s_per_gpu"]),
                         pct(p["mfu"]), pct(p["mfu_executed"]), num(p["peak_gpu_mem_reserved_gib"], ".1f"), f"`{name}.json`"])  # fmt: skip
    header = ["GPUs", "seq", "ac", "s/step", "tokens/s/GPU", "MFU", "MFU executed", "peak GPU GiB (reserved)", "raw"]
    return markdown(rows, header)


def changes_table(before: str) -> str:
    """offload=none tokens/s/GPU of the earlier sitting (sweeps and torchtitan files with the suffix ``_{before}``) beside
    this page's, per GPU count: what the changes since then bought, with torchtitan as the run-to-run yardstick."""
    rows = []
    for gpus in (1, 2):
        old, new = grid(f"grid_30b_h200_{gpus}gpu_{before}"), grid(f"grid_30b_h200_{gpus}gpu")
        key = ["offload", "dispatcher", "ac"]
        both = old.merge(new, on=key, suffixes=("_before", "_now"))
        for _, r in both[both["offload"] == "none"].iterrows():
            a, b = r["tokens_per_s_per_gpu_before"], r["tokens_per_s_per_gpu_now"]
            ratio = "" if pd.isna(a) or pd.isna(b) else f"{b / a:.2f}x"
            rows.append([gpus, "moe_lab", r["dispatcher"], r["ac"], num(a) or r["status_before"], num(b) or r["status_now"], ratio])
        titan_old, titan_new = torchtitan(f"torchtitan_h200_{gpus}gpu_{before}"), torchtitan(f"torchtitan_h200_{gpus}gpu")
        for ac in titan_new:
            a, b = titan_old[ac]["tokens_per_s_per_gpu"], titan_new[ac]["tokens_per_s_per_gpu"]
            rows.append([gpus, "torchtitan", "", ac, num(a), num(b), f"{b / a:.2f}x"])
    return markdown(rows, ["GPUs", "framework", "dispatcher", "ac", f"tokens/s/GPU at {before}", "tokens/s/GPU now", "now / before"])


def breakdown_table() -> str:
    rows = []
    for gpus in (1, 2):
        df = grid(f"grid_30b_h200_{gpus}gpu")
        for _, r in df[df["status"] == "ok"].iterrows():
            parts = [r.get(f"time.{c}") for c in CATEGORIES]
            total = sum(p for p in parts if p is not None and not pd.isna(p))
            rows.append([gpus, r["offload"], r["dispatcher"], r["ac"], *(num(1e3 * p, ".1f") for p in parts),
                         num(1e3 * r["time.step_s"], ".1f"), num(1e3 * total, ".1f")])  # fmt: skip
    header = ["GPUs", "offload", "dispatcher", "ac", *CATEGORIES, "profiled step", "sum of parts"]
    return markdown(rows, header)


def routing_table(balanced: str, skewed: list[str]) -> str:
    """offload=none, ac=selective on 2 GPUs: the balanced grid's points beside the routing-skew sweeps' (a point
    that failed in one sweep and ran in a later one shows once, as run), with each dispatcher's share of the step
    in expert GEMMs and the EP all-to-all, and fused over torch at each routing."""
    grid_points = grid(balanced)
    points = grid_points[(grid_points["offload"] == "none") & (grid_points["ac"] == "selective")].assign(routing="balanced")
    for sweep in skewed:
        points = pd.concat([points, grid(sweep).assign(routing=lambda d: "Zipf " + d["model.routing_skew"].astype(str))])
    points = points.sort_values("status", key=lambda s: s != "ok").drop_duplicates(["routing", "dispatcher"])
    rows = []
    for routing in points["routing"].unique():
        pair = points[points["routing"] == routing].set_index("dispatcher")
        speed = pair["tokens_per_s_per_gpu"]
        ratio = speed.get("fused", float("nan")) / speed.get("torch", float("nan"))
        for dispatcher, r in pair.sort_index(ascending=False).iterrows():
            rows.append([routing, dispatcher, r["status"], num(r.get("s_per_step"), ".3f"), num(r.get("tokens_per_s_per_gpu")),
                         pct(r.get("mfu")), num(1e3 * r.get("time.expert_gemm"), ".1f"), num(1e3 * r.get("time.ep_all_to_all"), ".1f"),
                         num(r.get("peak_gpu_mem_gib"), ".1f"), "" if pd.isna(ratio) else f"{ratio:.2f}x",
                         f"`{Path(r['run_dir']).parent.name}`"])  # fmt: skip
    header = ["routing", "dispatcher", "status", "s/step", "tokens/s/GPU", "MFU", "expert GEMM ms", "EP all-to-all ms",
              "peak GPU GiB", "fused / torch", "raw"]  # fmt: skip
    return markdown(rows, header)


def moe_layer_table(name: str) -> str:
    data = json.loads((RESULTS / f"{name}.json").read_text())
    rows = []
    for p in data["points"]:
        if "speedup" not in p:
            continue
        rows.append([p["model"].removeprefix("qwen3_").upper(), num(p["tokens_per_gpu"]), p["routing"], num(p["torch_ms"], ".2f"),
                     num(p["fused_ms"], ".2f"), num(p["torch_tflops"]), num(p["fused_tflops"]), f"{p['speedup']:.2f}x"])  # fmt: skip
    header = ["shape", "tokens/GPU", "routing", "torch ms", "fused ms", "torch TFLOP/s", "fused TFLOP/s", "speedup"]
    return markdown(rows, header)


def offload_depth_table() -> str:
    data = json.loads((RESULTS / "offload_gpu_h200.json").read_text())
    rows = []
    for mode in ("none", "optimizer", "full"):
        at4 = next((p for p in data["points"] if p["mode"] == mode and p["num_layers"] == 4), None)
        search = data["search"].get(mode, {})
        fits, fails = search.get("largest_fitting_num_layers"), search.get("smallest_failing_num_layers")
        deepest = f"{fits} (fails at {fails})" if search.get("exact") else f">= {fits} (not searched further)"
        rows.append([mode, num(at4["s_per_step"], ".3f"), num(at4["peak_gpu_mem_gib"], ".1f"), num(at4["peak_host_rss_gib"], ".1f"), deepest])
    return markdown(rows, ["offload", "s/step (4 layers)", "peak GPU GiB", "peak host GiB", "deepest proxy that fits one H200"])


TABLES = {
    "grid-2gpu": lambda: grid_table("grid_30b_h200_2gpu", "torchtitan_h200_2gpu"),
    "grid-1gpu": lambda: grid_table("grid_30b_h200_1gpu", "torchtitan_h200_1gpu"),
    "grid-2gpu-seq8192": lambda: grid_table("grid_30b_h200_2gpu_seq8192", "torchtitan_h200_2gpu_seq8192"),
    "torchtitan": lambda: torchtitan_table(["torchtitan_h200_1gpu", "torchtitan_h200_2gpu", "torchtitan_h200_2gpu_seq8192"]),
    "changes": lambda: changes_table("6e11ad8"),
    "breakdown": breakdown_table,
    "routing": lambda: routing_table("grid_30b_h200_2gpu", ["routing_skew_h200_2gpu", "routing_skew_h200_2gpu_rerun"]),
    "moe-layer-ep1": lambda: moe_layer_table("moe_layer_h200_ep1"),
    "moe-layer-ep2": lambda: moe_layer_table("moe_layer_h200_ep2"),
    "moe-layer-ep2-before": lambda: moe_layer_table("moe_layer_h200_ep2_3166bb1"),
    "offload-depth": offload_depth_table,
}


def render(doc: str) -> str:
    def table(m: re.Match) -> str:
        if m["name"] not in TABLES:
            raise KeyError(f"{DOC.name}: no generator for table {m['name']!r} (known: {', '.join(TABLES)})")
        return m.group(1) + TABLES[m["name"]]() + m.group(4)

    return BLOCK.sub(table, doc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the doc's tables are not what the results give")
    args = parser.parse_args()
    doc = DOC.read_text()
    new = render(doc)
    if args.check:
        if new != doc:
            sys.exit(f"{DOC} is out of date with results/: run python benchmarks/performance_tables.py")
        return
    DOC.write_text(new)


if __name__ == "__main__":
    main()
