"""The generated tables of README.md, docs/, experiments/README.md and the studies' READMEs, made from the committed
records (and the key reference, from the config schema and conf/; the study index, from the studies' READMEs).

    python -m moe_lab.report           # rewrite every generated table
    python -m moe_lab.report --check   # exit 1 if a table differs from what its records give

It works on the checkout the package is imported from (the records and docs stay there; a wheel carries neither).

A generated table sits between ``<!-- table: KIND PATH... -->`` and ``<!-- /table -->``; everything else is prose.
The marker names the records (paths from the repository root: a sweep directory, or a raw JSON file), and the
generated block ends with a line citing them, so a table always names the files it came from. Sweep directories
are read with ``moe_lab.results.load``, the loader the notebook uses.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import math
import re
import sys
from pathlib import Path

import pandas as pd

from moe_lab.metrics.trace import CATEGORIES
from moe_lab.results import load

ROOT = Path(__file__).resolve().parents[1]  # the checkout: the package's folder is its root's (pyproject's package-dir)
CONF = ROOT / "conf"  # a group's options: its yaml files
DOCS = [
    ROOT / "README.md",
    *sorted(ROOT.glob("docs/*.md")),
    ROOT / "experiments" / "README.md",
    *sorted(ROOT.glob("experiments/*/README.md")),
]
BLOCK = re.compile(r"(<!-- table: (?P<kind>[\w-]+)(?P<args>[^>]*?) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def markdown(rows: list[list], header: list[str]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def pct(x) -> str:
    return "" if x is None or pd.isna(x) else f"{100 * x:.1f} %"


def num(x, fmt=",.0f") -> str:
    return "" if x is None or pd.isna(x) else format(x, fmt)


def cite(path: str) -> str:
    return f"`{path}`"


@functools.cache
def sweep(path: str) -> pd.DataFrame:
    """A sweep directory's points, one row each."""
    return load(ROOT / path)


def results_in_job_order(path: str) -> list[Path]:
    """A sweep directory's result.json files, ordered by job number (the folder names 0, 1, ..., 10)."""
    return sorted((ROOT / path).glob("*/result.json"), key=lambda p: int(p.parent.name))


@functools.cache
def raw(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


@functools.cache
def torchtitan_ac_settings() -> tuple[str, ...]:
    """Every AC setting torchtitan offers that the baseline can run: the keys of the study script's ``AC_SETTINGS``
    literal (read, not imported: the script is no module of the package)."""
    script = ast.parse((ROOT / "experiments" / "torchtitan_baseline" / "torchtitan_baseline.py").read_text())
    settings = next(
        node.value
        for node in script.body
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["AC_SETTINGS"]
    )
    return tuple(ast.literal_eval(settings))


def titan_setting(point: dict) -> str:
    """A torchtitan point's AC setting as experiments/torchtitan_baseline/torchtitan_baseline.py names it (none, full,
    op-selective, layer-selective); files written before it ran all four call op-level selective AC "selective"."""
    if point["ac"] != "selective":
        return point["ac"]
    if "--activation_checkpoint.selective_ac_option op" not in point["command"]:
        raise ValueError(f"a torchtitan point named 'selective' that is not op-level: {point['command']}")
    return "op-selective"


def torchtitan_points(path: str) -> dict[str, dict]:
    """Every point of one raw torchtitan file (one GPU count and seq each), by AC setting."""
    return {titan_setting(p): p for p in raw(path)["points"]}


def torchtitan(path: str) -> dict[str, dict]:
    """The successful points of one raw torchtitan file, by AC setting."""
    return {ac: p for ac, p in torchtitan_points(path).items() if p["status"] == "ok"}


def fastest(points: dict[str, dict]) -> tuple[str, dict | None]:
    """The (name, point) with the most tokens/s/GPU; ("(none ok)", None) without any."""
    return max(points.items(), key=lambda item: item[1]["tokens_per_s_per_gpu"], default=("(none ok)", None))


def value(point, key: str):
    """A field of a point (a record row or a raw file's point), None without a point."""
    return None if point is None else point[key]


def ratio(ours: dict | None, theirs: dict | None) -> str:
    return (
        f"{ours['tokens_per_s_per_gpu'] / theirs['tokens_per_s_per_gpu']:.2f}x"
        if ours is not None and theirs is not None
        else ""
    )


def grid(path: str, baseline: str | None = None) -> str:
    """A grid sweep, one row per point; with a torchtitan file, each point's tokens/s/GPU over torchtitan's fastest
    setting in that file."""
    titan_ac, titan_best = fastest(torchtitan(baseline)) if baseline else (None, None)
    rows = []
    for _, r in sweep(path).iterrows():
        rows.append(
            [
                r["offload"],
                r["dispatcher"],
                r["ac"],
                r["status"],
                num(r.get("s_per_step"), ".3f"),
                num(r.get("tokens_per_s_per_gpu")),
                pct(r.get("mfu")),
                pct(r.get("mfu_executed")),
                num(r.get("peak_gpu_mem_gib"), ".1f"),
                num(r.get("peak_host_rss_gib"), ".1f"),
                ratio(r if r["status"] == "ok" else None, titan_best),
            ]
        )
    header = [
        "offload",
        "dispatcher",
        "ac",
        "status",
        "s/step",
        "tokens/s/GPU",
        "MFU",
        "MFU executed",
        "peak GPU GiB",
        "peak host GiB",
    ] + ([f"vs torchtitan's fastest ({titan_ac})"] if baseline else [])
    return markdown([row[: len(header)] for row in rows], header)


def torchtitan_table(*paths: str) -> str:
    rows = []
    for path in paths:
        for ac, p in torchtitan_points(path).items():
            ok = p["status"] == "ok"
            rows.append(
                [
                    p["gpus"],
                    num(p["seq_len"]),
                    ac,
                    p["status"],
                    num(p["s_per_step"], ".3f") if ok else "",
                    num(p.get("tokens_per_s_per_gpu")),
                    pct(p.get("mfu")),
                    pct(p.get("mfu_executed")),
                    num(p.get("peak_gpu_mem_reserved_gib"), ".1f"),
                    cite(path),
                ]
            )
    header = [
        "GPUs",
        "seq",
        "ac",
        "status",
        "s/step",
        "tokens/s/GPU",
        "MFU",
        "MFU executed",
        "peak GPU GiB (reserved)",
        "raw",
    ]
    return markdown(rows, header)


# A proxy's name from either side: moe_lab's model option or torchtitan's flavour, with the layers kept.
PROXY_NAMES = {
    "qwen3_30b": "Qwen3-30B-A3B",
    "qwen3_235b": "Qwen3-235B-A22B",
    "30B-A3B": "Qwen3-30B-A3B",
    "235B-A22B": "Qwen3-235B-A22B",
}


def sweep_setup(path: str) -> tuple[str, int, int]:
    """(proxy, GPUs, seq) every point of a moe_lab sweep shares, from its records' configs."""
    setups = set()
    for run_dir in sweep(path)["run_dir"]:
        cfg = json.loads((Path(run_dir) / "result.json").read_text())["config"]
        setups.add(
            (
                f"{PROXY_NAMES[cfg['model']['name']]}, {cfg['model']['num_layers']} layers",
                cfg["trainer"]["nproc_per_node"],
                cfg["data"]["seq_len"],
            )
        )
    if len(setups) != 1:
        raise ValueError(f"{path}: points of more than one proxy / GPU count / seq: {sorted(setups)}")
    return setups.pop()


def titan_setup(path: str) -> tuple[str, int, int]:
    data = raw(path)
    base = data["proxy"]["torchtitan_flavour"].removesuffix(f"-{data['proxy']['layers']}L")
    setups = {
        (f"{PROXY_NAMES[base]}, {data['proxy']['layers']} layers", p["gpus"], p["seq_len"]) for p in data["points"]
    }
    if len(setups) != 1:
        raise ValueError(f"{path}: points of more than one GPU count / seq: {sorted(setups)}")
    return setups.pop()


def titan_covered(points: dict[str, dict]) -> str:
    """The AC settings a torchtitan file ran (a failed one with its status), and those of torchtitan's it did not."""
    ran = ", ".join(ac if p["status"] == "ok" else f"{ac} ({p['status']})" for ac, p in points.items())
    missing = [ac for ac in torchtitan_ac_settings() if ac not in points]
    return ran + (f"; not run: {', '.join(missing)}" if missing else "")


def grid_covered(points: pd.DataFrame) -> str:
    """What a moe_lab sweep ran, axis by axis (its points are every combination of these), its failed points, and
    the dispatchers and AC modes moe_lab has that it did not run."""
    axes = {axis: list(dict.fromkeys(points[axis])) for axis in ("dispatcher", "ac", "offload")}
    if len(points.drop_duplicates(list(axes))) != len(points) or len(points) != math.prod(map(len, axes.values())):
        raise ValueError(f"not a grid of {', '.join(axes)}: {points[list(axes)].values.tolist()}")
    text = "; ".join(f"{axis} {', '.join(values)}" for axis, values in axes.items())
    text += "".join(
        f"; {r['dispatcher']} + {r['ac']}, offload {r['offload']}: {r['status']}"
        for _, r in points[points["status"] != "ok"].iterrows()
    )
    missing = [
        f"{axis} {option.stem}"
        for axis in ("dispatcher", "ac")
        for option in sorted((CONF / axis).glob("*.yaml"))
        if option.stem not in axes[axis]
    ]
    return text + (f"; not run: {', '.join(missing)}" if missing else "")


def best_vs_best(*paths: str) -> str:
    """moe_lab's fastest point against torchtitan's fastest setting on the same proxy, GPUs and seq: pairs of (a
    moe_lab sweep, a torchtitan file), a row each, with both memories, the ratio and which settings each side ran
    (a setting neither ran is not in the comparison)."""
    if len(paths) % 2:
        raise ValueError("best-vs-best takes pairs: a moe_lab sweep, then the torchtitan file of the same setup")
    rows = []
    for ours_path, titan_path in zip(paths[::2], paths[1::2]):
        setup = sweep_setup(ours_path)
        if titan_setup(titan_path) != setup:
            raise ValueError(f"best-vs-best: {ours_path} is {setup}, {titan_path} is {titan_setup(titan_path)}")
        points = sweep(ours_path)
        name = lambda r: (
            f"{r['dispatcher']} + {r['ac']} AC" + (f", offload {r['offload']}" if r["offload"] != "none" else "")
        )  # noqa: E731
        ours = {name(r): r for _, r in points.iterrows()}
        ours_ac, ours_best = fastest({n: r for n, r in ours.items() if r["status"] == "ok"})
        titan_ac, titan_best = fastest(torchtitan(titan_path))
        proxy, gpus, seq = setup
        rows.append(
            [
                proxy,
                gpus,
                num(seq),
                ours_ac,
                num(value(ours_best, "tokens_per_s_per_gpu")),
                pct(value(ours_best, "mfu")),
                num(value(ours_best, "peak_gpu_mem_gib"), ".1f"),
                titan_ac,
                num(value(titan_best, "tokens_per_s_per_gpu")),
                pct(value(titan_best, "mfu")),
                num(value(titan_best, "peak_gpu_mem_reserved_gib"), ".1f"),
                ratio(ours_best, titan_best),
                grid_covered(points),
                titan_covered(torchtitan_points(titan_path)),
            ]
        )
    header = [
        "proxy",
        "GPUs",
        "seq",
        "moe_lab fastest",
        "tokens/s/GPU",
        "MFU",
        "peak GPU GiB",
        "torchtitan fastest",
        "tokens/s/GPU",
        "MFU",
        "peak GPU GiB (reserved)",
        "fastest / fastest",
        "moe_lab ran",
        "torchtitan ran",
    ]
    return markdown(rows, header)


def changes(before: str, now: str, titan_before: str, titan_now: str) -> str:
    """offload=none tokens/s/GPU of an earlier sitting beside a later one, at one GPU count, with torchtitan in both
    sittings as the yardstick of run-to-run drift."""
    old, new = sweep(before), sweep(now)
    both = old.merge(new, on=["offload", "dispatcher", "ac"], suffixes=("_before", "_now"))
    gpus = int(new["env.world_size"].iloc[0])
    rows = []
    for _, r in both[both["offload"] == "none"].iterrows():
        a, b = r["tokens_per_s_per_gpu_before"], r["tokens_per_s_per_gpu_now"]
        ratio = "" if pd.isna(a) or pd.isna(b) else f"{b / a:.2f}x"
        rows.append(
            [gpus, "moe_lab", r["dispatcher"], r["ac"], num(a) or r["status_before"], num(b) or r["status_now"], ratio]
        )
    titan_old, titan_new = torchtitan(titan_before), torchtitan(titan_now)
    for ac in [ac for ac in titan_new if ac in titan_old]:
        a, b = titan_old[ac]["tokens_per_s_per_gpu"], titan_new[ac]["tokens_per_s_per_gpu"]
        rows.append([gpus, "torchtitan", "", ac, num(a), num(b), f"{b / a:.2f}x"])
    header = [
        "GPUs",
        "framework",
        "dispatcher",
        "ac",
        f"tokens/s/GPU {Path(before).name}",
        f"tokens/s/GPU {Path(now).name}",
        "later / earlier",
    ]
    return markdown(rows, header)


def breakdown(*paths: str) -> str:
    """One profiled step's compute-stream time by category, in ms, for every ok point of the sweeps; a category no
    point's record has (one added to moe_lab.metrics.trace after they were made) gets no column."""
    points = pd.concat([sweep(path) for path in paths])
    points = points[points["status"] == "ok"]
    categories = [c for c in CATEGORIES if f"time.{c}" in points and points[f"time.{c}"].notna().any()]
    rows = []
    for _, r in points.iterrows():
        parts = [r[f"time.{c}"] for c in categories]
        total = sum(p for p in parts if not pd.isna(p))
        rows.append(
            [
                int(r["env.world_size"]),
                r["offload"],
                r["dispatcher"],
                r["ac"],
                *(num(1e3 * p, ".1f") for p in parts),
                num(1e3 * r["time.step_s"], ".1f"),
                num(1e3 * total, ".1f"),
            ]
        )
    header = ["GPUs", "offload", "dispatcher", "ac", *categories, "profiled step", "sum of parts"]
    return markdown(rows, header)


def routing(balanced: str, *skewed: str) -> str:
    """offload=none, ac=selective: the balanced grid's points beside the routing-skew sweeps' (a point that failed in
    one sweep and ran in a later one shows once, as run), with each dispatcher's expert GEMM and EP all-to-all time
    and fused over torch at each routing."""
    grid_points = sweep(balanced).assign(raw=balanced)
    points = grid_points[(grid_points["offload"] == "none") & (grid_points["ac"] == "selective")].assign(
        routing="balanced"
    )
    for path in skewed:
        points = pd.concat(
            [points, sweep(path).assign(raw=path, routing=lambda d: "Zipf " + d["model.routing_skew"].astype(str))]
        )
    points = points.sort_values("status", key=lambda s: s != "ok").drop_duplicates(["routing", "dispatcher"])
    rows = []
    for name in points["routing"].unique():
        pair = points[points["routing"] == name].set_index("dispatcher")
        speed = pair["tokens_per_s_per_gpu"]
        ratio = speed.get("fused", float("nan")) / speed.get("torch", float("nan"))
        for dispatcher, r in pair.sort_index(ascending=False).iterrows():
            rows.append(
                [
                    name,
                    dispatcher,
                    r["status"],
                    num(r.get("s_per_step"), ".3f"),
                    num(r.get("tokens_per_s_per_gpu")),
                    pct(r.get("mfu")),
                    num(1e3 * r.get("time.expert_gemm"), ".1f"),
                    num(1e3 * r.get("time.ep_all_to_all"), ".1f"),
                    num(r.get("peak_gpu_mem_gib"), ".1f"),
                    "" if pd.isna(ratio) else f"{ratio:.2f}x",
                    cite(r["raw"]),
                ]
            )
    header = [
        "routing",
        "dispatcher",
        "status",
        "s/step",
        "tokens/s/GPU",
        "MFU",
        "expert GEMM ms",
        "EP all-to-all ms",
        "peak GPU GiB",
        "fused / torch",
        "raw",
    ]
    return markdown(rows, header)


def moe_layer(path: str) -> str:
    rows = []
    for p in raw(path)["points"]:
        if "speedup" in p:
            rows.append(
                [
                    p["model"].removeprefix("qwen3_").upper(),
                    num(p["tokens_per_gpu"]),
                    p["routing"],
                    num(p["torch_ms"], ".2f"),
                    num(p["fused_ms"], ".2f"),
                    num(p["torch_tflops"]),
                    num(p["fused_tflops"]),
                    f"{p['speedup']:.2f}x",
                ]
            )
    header = ["shape", "tokens/GPU", "routing", "torch ms", "fused ms", "torch TFLOP/s", "fused TFLOP/s", "speedup"]
    return markdown(rows, header)


def offload_depth(path: str) -> str:
    data = raw(path)
    rows = []
    for mode in ("none", "optimizer", "full"):
        at4 = next(p for p in data["points"] if p["mode"] == mode and p["num_layers"] == 4)
        search = data["search"].get(mode, {})
        fits, fails = search.get("largest_fitting_num_layers"), search.get("smallest_failing_num_layers")
        deepest = f"{fits} (fails at {fails})" if search.get("exact") else f">= {fits} (not searched further)"
        rows.append(
            [
                mode,
                num(at4["s_per_step"], ".3f"),
                num(at4["peak_gpu_mem_gib"], ".1f"),
                num(at4["peak_host_rss_gib"], ".1f"),
                deepest,
            ]
        )
    return markdown(
        rows, ["offload", "s/step (4 layers)", "peak GPU GiB", "peak host GiB", "deepest proxy that fits one H200"]
    )


def host_optimizer(path: str) -> str:
    """Each case at each thread count of the file: parameters/s where the case steps parameters, bytes/s, share of
    the in-place bandwidth ceiling at that thread count."""
    rows = [
        [
            r["case"],
            r["threads"],
            num(r.get("params_per_s", float("nan")) / 1e9, ".2f"),
            num(r["bytes_per_s"] / 1e9, ".1f"),
            pct(r["fraction_of_ceiling"]),
        ]
        for r in raw(path)["rows"]
    ]
    return markdown(rows, ["case", "threads", "G params/s", "GB/s", "of ceiling"])


def points(*paths: str) -> str:
    """Single runs (result.json-shaped files or sweep directories), one row each."""
    rows = []
    for path in paths:
        df = (
            sweep(path)
            if (ROOT / path).is_dir()
            else pd.DataFrame([raw(path)["metrics"] | {"status": raw(path)["status"]}])
        )
        for _, r in df.iterrows():
            rows.append(
                [
                    cite(path),
                    r["status"],
                    num(r.get("s_per_step"), ".3f"),
                    num(r.get("tokens_per_s_per_gpu")),
                    pct(r.get("mfu")),
                    num(r.get("peak_gpu_mem_gib"), ".1f"),
                ]
            )
    return markdown(rows, ["raw", "status", "s/step", "tokens/s/GPU", "MFU", "peak GPU GiB"])


def plan(*paths: str) -> str:
    """Every ok point of the sweeps planned (``moe_lab.plan``) on the hardware it ran on, beside what it measured."""
    from moe_lab.plan.records import plan_record

    rows = []
    for path in paths:
        for result in results_in_job_order(path):
            record = json.loads(result.read_text())
            if record["status"] != "ok":
                continue
            m, p = record["metrics"], plan_record(record)["metrics"]
            choices = record["choices"]
            err = lambda key, m=m, p=p: f"{100 * (p[key] / m[key] - 1):+.0f} %"  # noqa: E731
            rows.append(
                [
                    cite(str(result.parent.relative_to(ROOT / path.split("/records/")[0]))),
                    record["world_size"],
                    choices["offload"],
                    choices["dispatcher"],
                    choices["ac"],
                    record["config"]["trainer"].get("grad_accum", 1),
                    num(m["s_per_step"], ".3f"),
                    num(p["s_per_step"], ".3f"),
                    err("s_per_step"),
                    num(m["peak_gpu_mem_gib"], ".1f"),
                    num(p["peak_gpu_mem_gib"], ".1f"),
                    err("peak_gpu_mem_gib"),
                    num(m["peak_host_rss_gib"], ".1f"),
                    num(p["peak_host_rss_gib"], ".1f"),
                ]
            )
    header = [
        "point",
        "GPUs",
        "offload",
        "dispatcher",
        "ac",
        "micro-batches",
        "s/step measured",
        "planned",
        "error",
        "peak GPU GiB measured",
        "planned",
        "error",
        "peak host GiB measured",
        "planned",
    ]
    return markdown(rows, header)


def plan_breakdown(*paths: str) -> str:
    """The profiled step's breakdown beside the plan's, in ms per category (measured / planned), for every ok point
    of the sweeps that was profiled."""
    from moe_lab.plan.records import plan_record

    rows, used = [], set()
    for path in paths:
        for result in results_in_job_order(path):
            record = json.loads(result.read_text())
            measured = (record.get("metrics") or {}).get("trace_breakdown") or {}
            if record["status"] != "ok" or "seconds" not in measured:
                continue
            planned = plan_record(record)["metrics"]["trace_breakdown"]["seconds"]
            parts = {c: (measured["seconds"].get(c, 0.0), planned.get(c, 0.0)) for c in CATEGORIES}
            used |= {c for c, (m, p) in parts.items() if m > 5e-4 or p > 5e-4}
            rows.append((record, parts))
    categories = [c for c in CATEGORIES if c in used]
    table = [
        [
            record["world_size"],
            record["choices"]["dispatcher"],
            record["choices"]["ac"],
            *(f"{1e3 * m:.0f} / {1e3 * p:.0f}" for m, p in (parts[c] for c in categories)),
        ]
        for record, parts in rows
    ]
    return markdown(table, ["GPUs", "dispatcher", "ac", *categories])


def plan_depth(path: str) -> str:
    """The offload depth search's deepest proxy per mode beside the planner's (``depth_search_plans``: its commands
    planned on the GPU and host it ran on)."""
    from moe_lab.plan.records import depth_search_plans

    data = raw(path)
    planned = depth_search_plans(data)
    rows = [
        [
            mode,
            data["search"][mode]["largest_fitting_num_layers"],
            data["search"][mode]["smallest_failing_num_layers"],
            planned[mode],
        ]
        for mode in ("none", "optimizer", "full")
    ]
    return markdown(rows, ["offload", "deepest measured", "fails at", "deepest planned"])


def plan_reference(*paths: str) -> str:
    """The published Qwen3-235B-A22B reference (32 B300) beside the plans of the matching moe_lab configurations."""
    from moe_lab.plan.records import reference_235b

    rows = [
        [
            r["reference"],
            r["dispatcher"],
            r["ac"],
            num(r["published_s"], ".2f"),
            num(r["planned_s"], ".2f"),
            f"{100 * (r['planned_s'] / r['published_s'] - 1):+.0f} %",
            pct(r["planned_mfu"]),
            num(r["peak_gpu_mem_gib"], ".0f"),
            "yes" if r["fits"] else "no",
            "yes" if r["compared"] else "no (shown)",
        ]
        for r in reference_235b()
    ]
    header = [
        "reference row",
        "planned dispatcher",
        "ac",
        "published s/step",
        "planned s/step",
        "error",
        "planned MFU",
        "planned peak GiB",
        "fits 268 GiB",
        "held to 20 %",
    ]
    return markdown(rows, header)


def planned(*paths: str) -> str:
    """Points planned before they run (``python -m moe_lab.plan -m``): each point's sweep overrides (those it does not
    share with every other point of its sweep), the predicted step and peak memory, and whether it fits."""
    rows = []
    for path in paths:
        records = [json.loads(r.read_text()) for r in results_in_job_order(path)]
        # a point is named by what sets it apart from the sweep's other points (all of it when it is alone)
        common = set.intersection(*(set(r["overrides"]) for r in records)) if len(records) > 1 else set()
        for record in records:
            m, p = record["metrics"], record["plan"]
            swept = " ".join(o for o in record["overrides"] if o not in common and not o.startswith("+experiment="))
            rows.append(
                [
                    cite(path),
                    swept,
                    num(m["s_per_step"], ".3f"),
                    num(m["tokens_per_s_per_gpu"]),
                    pct(m["mfu"]),
                    num(m["peak_gpu_mem_gib"], ".1f"),
                    num(p["memory"]["host_total_gib"], ".0f"),
                    "yes" if p["fits"] else f"no: {p['fits_why']}",
                ]
            )
    return markdown(
        rows, ["plans", "point", "s/step", "tokens/s/GPU", "MFU", "peak GPU GiB", "host GiB per rank", "fits"]
    )


def replicas(*paths: str) -> str:
    """Plans of one model on one mesh at each ``parallel.dp_replicate`` x ``parallel.reshard_after_forward``
    (``python -m moe_lab.plan -m``, one sweep a path): at each layout the fastest setting of AC (with ``ac.keep``,
    ``dispatcher.save``, activation offload) that fits, its tokens/s/GPU and peak, the exposed FSDP2 communication
    planned at the sweep's own AC, and the layout's fastest against the fastest with one replica."""
    rows = []
    for path in paths:
        points = [(result.parent.name, json.loads(result.read_text())) for result in results_in_job_order(path)]
        points = [(name, record) for name, record in points if record["status"] == "ok"]
        speed = {name: (r["plan"]["fastest_fitting"] or {}).get("tokens_per_s_per_gpu") for name, r in points}
        one = max((speed[n] for n, r in points if speed[n] and r["plan"]["mesh"]["dp_replicate"] == 1), default=None)
        best = max(filter(None, speed.values()), default=None)
        for name, record in points:
            p = record["plan"]
            mesh, fit, exposed = p["mesh"], p["fastest_fitting"], p["exposed_communication_s"]
            tokens = speed[name]
            versus = f"{tokens / one:.3f}x{' (fastest)' if tokens == best else ''}" if tokens and one else ""
            rows.append(
                [
                    record["choices"]["model"],
                    mesh["world"],
                    f"{mesh['dp_replicate']} x {mesh['dp_shard']}",
                    str(mesh["reshard_after_forward"]).lower(),
                    fit["overrides"] if fit else "nothing fits",
                    num(tokens),
                    num(fit["peak_gpu_mem_gib"], ".1f") if fit else "",
                    num(1e3 * (exposed["fsdp_all_gather"] + exposed["fsdp_reduce_scatter"]), ".0f"),
                    versus,
                    cite(f"{path}/{name}"),
                ]
            )
    header = [
        "model",
        "GPUs",
        "replicas x shard",
        "reshard_after_forward",
        "fastest that fits",
        "tokens/s/GPU",
        "peak GPU GiB",
        "exposed FSDP2 ms at the preset's AC",
        "vs the fastest at R = 1",
        "raw",
    ]
    return markdown(rows, header)


def keys(*paths: str) -> str:
    """The config reference: every group with its options (the default first), each option's own keys with the
    values its yaml sets, and every schema key (trainer.*, parallel.*, profile.*) with its default: what
    ``python -m moe_lab.train --help`` prints, from the same sources (``moe_lab.config.help``)."""
    import yaml

    from moe_lab.config.help import SECTIONS, key_rows, option_line
    from moe_lab.config.schema import GROUPS, default_options

    defaults = default_options()
    rows = []
    for group, what in GROUPS.items():
        options = sorted((CONF / group).glob("*.yaml"), key=lambda p: (p.stem != defaults.get(group), p.stem))
        for path in options:
            node = yaml.safe_load(path.read_text()) or {}
            own = ", ".join(
                f"`{k}={_yaml_value(v)}`"
                for k, v in node.items()
                if not k.startswith("_") and "${hf_config:" not in str(v)
            )
            rows.append(
                [
                    f"`{group}`" + (f" ({what})" if path == options[0] else ""),
                    f"`{path.stem}`" + (" (default)" if path.stem == defaults.get(group) else ""),
                    option_line(path, width=400).replace("|", "\\|"),
                    own,
                ]
            )
    text = markdown(rows, ["group", "option", "what it is", "its keys (`<group>.<key>`), as its yaml sets them"])
    key_table = [
        [
            f"`{key}.*`" if default is None else f"`{key}`",
            "" if default is None else f"`{default}`",
            what.replace("|", "\\|"),
        ]
        for section, schema in SECTIONS.items()
        for key, default, what in key_rows(section, schema)
    ]
    return text + "\n" + markdown(key_table, ["key", "default", "what it does"])


def _yaml_value(value) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value).replace(" ", "")


# A study README's paragraphs that the index reads: its question, and the headline its owner keeps beside its tables.
STUDY_PARAGRAPH = re.compile(
    r"^\*\*(?P<name>Question|Headline)(?: \([^)]*\))?\.\*\* (?P<text>.*?)(?:\n\n|\Z)", re.M | re.S
)


def _first_sentence(text: str) -> str:
    text = " ".join(text.split()).replace("](../", "](")  # a study's links to its neighbours, from the index
    return re.split(r"(?<=[.?])\s", text, maxsplit=1)[0]


def _sittings(study: Path) -> list[tuple[str, str]]:
    """(machine folder, newest sitting's UTC start) per folder of a study's records/, newest first."""
    out = []
    for machine in sorted(p for p in (study / "records").glob("*") if p.is_dir()):
        starts = sorted(
            re.match(r"\d{4}-\d\d-\d\d(_\d\d-\d\d)?", p.name)[0]
            for p in machine.iterdir()
            if re.match(r"\d{4}-\d\d-\d\d", p.name)
        )
        if starts:
            out.append((machine.name, starts[-1]))
    return sorted(out, key=lambda item: item[1], reverse=True)


def _utc(start: str) -> str:
    """A record's name as a time: 2026-12-01_10-41 -> 2026-12-01 10:41."""
    date, _, time = start.partition("_")
    return f"{date} {time.replace('-', ':')}".strip()


def studies(path: str) -> str:
    """The study index: each study's question (its README's **Question.**, else its title), what its records hold
    (machine folders and their newest sitting, or not run) and its headline (its README's **Headline.**)."""
    rows = []
    for readme in sorted((ROOT / path).glob("*/README.md")):
        study, text = readme.parent, readme.read_text()
        paragraphs = {m["name"]: m["text"] for m in STUDY_PARAGRAPH.finditer(text)}
        title = text.splitlines()[0].removeprefix("# ").split(": ", 1)[-1]
        question = _first_sentence(paragraphs["Question"]) if "Question" in paragraphs else title
        ran = "; ".join(f"{machine} ({_utc(start)})" for machine, start in _sittings(study))
        rows.append(
            [
                f"[{study.name}]({study.name}/README.md)",
                question.replace("|", "\\|"),
                ran or "not run",
                " ".join(paragraphs.get("Headline", "-").split()).replace("](../", "](").replace("|", "\\|"),
            ]
        )
    return markdown(
        rows, ["study", "question", "records: machine (newest sitting, UTC)", "headline (the study's README)"]
    )


KINDS = {
    "grid": grid,
    "torchtitan": torchtitan_table,
    "best-vs-best": best_vs_best,
    "changes": changes,
    "breakdown": breakdown,
    "routing": routing,
    "moe-layer": moe_layer,
    "offload-depth": offload_depth,
    "host-optimizer": host_optimizer,
    "points": points,
    "plan": plan,
    "plan-depth": plan_depth,
    "plan-breakdown": plan_breakdown,
    "plan-reference": plan_reference,
    "planned": planned,
    "replicas": replicas,
    "keys": keys,
    "studies": studies,
}


def table(kind: str, paths: list[str]) -> str:
    """The generated block: the table, then the files it came from (tables with a raw column cite per row)."""
    if kind not in KINDS:
        raise KeyError(f"no generator for table kind {kind!r} (known: {', '.join(KINDS)})")
    for path in paths:
        if not (ROOT / path).exists():
            raise FileNotFoundError(f"table {kind}: no record at {path}")
    body = KINDS[kind](*paths)
    # the index links each study's README; a raw column may cite every record already
    cited = kind == "studies" or all(f"`{p}`" in body for p in paths)
    return body if cited else body + "\nRaw: " + ", ".join(map(cite, paths)) + "\n"


def render(doc: str) -> str:
    return BLOCK.sub(lambda m: m.group(1) + table(m["kind"], m["args"].split()) + m.group(5), doc)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if a generated table is not what its records give")
    args = parser.parse_args(argv)
    stale = []
    for path in DOCS:
        doc = path.read_text()
        new = render(doc)
        if new != doc:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(new)
    if args.check and stale:
        sys.exit(f"out of date with their records: {', '.join(map(str, stale))}: run python -m moe_lab.report")
    rewritten = "" if args.check else f"{len(stale)} rewritten from their records, "
    print(f"{len(DOCS)} docs' generated tables: {rewritten}{'all' if args.check else 'the rest'} match their records")


if __name__ == "__main__":
    main()
