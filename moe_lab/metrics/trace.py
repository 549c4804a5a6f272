"""Profile a window of steady-state steps and break one step's time down by what it was spent on.

``StepProfiler`` wraps ``torch.profiler`` over ``profile.wait`` skipped steps, ``profile.warmup`` steps and
``profile.active`` recorded steps, and saves each rank's Chrome trace (``trace_rank<r>.json.gz``, opens in Perfetto
and TensorBoard). ``breakdown(trace)`` then partitions the recorded steps' time into the categories below and
averages over them, so the parts sum to one step:

- on CUDA, the compute stream's timeline (the stream with the most kernel time): each kernel's time goes to its
  category; idle time on the compute stream goes to what runs elsewhere at that moment, in this order: a collective
  on another stream (exposed communication), offload=full's host optimizer step on a CPU thread (``host_step``), a
  host <-> device copy on another stream (``pcie``: offload's gradient, weight and state traffic), an optimizer
  working on another stream or CPU thread (``optimizer``); else ``idle``. A copy between host and device on the
  compute stream itself is ``pcie`` too;
- on CPU, the main thread's timeline: each op's self time goes to its category; time in no op goes to ``idle``
  (Python and launch overhead).

A kernel or op gets the category of the highest-priority rule that matches its own name, the name of an enclosing
op or ``record_function`` scope, or — for a backward op — the enclosing scopes of the forward op that created it
(linked by autograd sequence number). What matches no rule is ``other``, and its names are listed.

Any torch.profiler Chrome trace with ProfilerStep spans can be broken down the same way, e.g. one from another
framework's run:  python -m moe_lab.metrics.trace trace_rank0.json.gz
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch

# In priority order: a grouped GEMM inside the dispatch scope is expert GEMM, an all-to-all inside it is all-to-all.
# The fused dispatcher's op (moe_lab::fused_moe) is glue but for its GEMMs (DeepGEMM's, or torch._grouped_mm's
# cutlass kernels, whose mangled names say GroupProblemShape) and its symmetric-memory barriers (the EP exchange).
# A host <-> device copy is PCIe traffic whatever op or scope issued it; offload=full's worker steps in an
# ``optimizer.host_step`` scope (``optimizer.offload_full_chunk`` in traces before issue 18).
RULES = {
    "ep_all_to_all": r"all_?to_?all|alltoall|sendrecv|exchange_counts|symmetric_memory",
    "fsdp_all_gather": r"all_?gather",
    "fsdp_reduce_scatter": r"reduce_?scatter|post_backward_reduce",
    "pcie": r"^Memcpy (HtoD|DtoH)",
    "attention": r"attention|flash|fmha|sdpa",
    "expert_gemm": r"grouped|GroupProblemShape|deep_gemm|moe_lab::expert_compute",
    "dense_gemm": r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$|gemm|nvjet|cutlass|cublas|xmma",
    "host_step": r"^optimizer\.(host_step|offload_full_chunk)$",
    "optimizer": r"^optimizer\.|multi_tensor_apply|adam",
    "dispatch_glue": r"moe_lab::dispatch|moe_lab::fused_moe",
}
# Kernels that no op or scope explains: compiled blocks launch Inductor's Triton kernels outside any aten op, and
# inside a decoder block the sorting / indexing / scattering ones are the dispatcher's (embedding and loss run eager).
KERNEL_RULES = {"dispatch_glue": r"^triton_.*(sort|scatter|gather|index|bincount|cumsum|histc|topk|repeat_interleave)"}
CATEGORIES = (*RULES, "idle", "other")
COMMUNICATION = ("ep_all_to_all", "fsdp_all_gather", "fsdp_reduce_scatter")
# What the compute stream can wait for, in the order its idle time is given to them: collectives on their streams,
# offload=full's host step on a CPU thread, host <-> device copies on side streams, an optimizer working elsewhere.
WAITED_ON = (*COMMUNICATION, "host_step", "pcie", "optimizer")
_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in RULES.items()]
_KERNEL_PATTERNS = _PATTERNS + [(name, re.compile(pattern)) for name, pattern in KERNEL_RULES.items()]
_STEP = re.compile(r"^ProfilerStep#\d+$")


def classify(name: str, patterns=_PATTERNS) -> str | None:
    return next((category for category, pattern in patterns if pattern.search(name)), None)


class StepProfiler:
    """Context manager around the training loop; call ``step()`` once per step. Does nothing unless enabled."""

    def __init__(self, cfg, run_dir: str | Path, rank: int):
        self.enabled = bool(cfg.enabled)
        self.path = Path(run_dir) / f"trace_rank{rank}.json.gz"
        self.profiler = None
        if self.enabled:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=cfg.wait, warmup=cfg.warmup, active=cfg.active, repeat=1),
                on_trace_ready=lambda prof: prof.export_chrome_trace(str(self.path)),
                # offload=full steps the optimizer in a CPU thread of its own, which the GPU may wait for
                experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
            )

    @classmethod
    def off(cls) -> StepProfiler:
        return cls(SimpleNamespace(enabled=False), ".", 0)

    def __enter__(self):
        if self.profiler:
            self.profiler.__enter__()
        return self

    def __exit__(self, *exc):
        if self.profiler:
            self.profiler.__exit__(*exc)

    def step(self) -> None:
        if self.profiler:
            self.profiler.step()

    def where(self) -> list[str]:
        """Where the trace went, in lines for the run's log."""
        if not (self.enabled and self.path.exists()):
            return []
        return [f"trace: {self.path} (Perfetto or TensorBoard; breakdown: python -m moe_lab.metrics.trace {self.path})"]

    def breakdown(self) -> dict | None:
        """The recorded steps' breakdown; a trace it cannot read is reported in place of the breakdown rather than
        failing a run that trained fine."""
        if not self.enabled:
            return None
        try:
            return breakdown(self.path)
        except (OSError, ValueError, KeyError) as e:
            return {"error": f"{type(e).__name__}: {e}"}


def load_trace(path: str | Path) -> list[dict]:
    path = Path(path)
    with gzip.open(path, "rt") if path.suffix == ".gz" else open(path) as f:
        return json.load(f)["traceEvents"]


def breakdown(trace: str | Path | list[dict], top_other: int = 15) -> dict:
    """Mean seconds per recorded step by category, the mean step time, and the largest ``other`` names."""
    events = load_trace(trace) if isinstance(trace, (str, Path)) else trace
    host = ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver")  # runtime calls link kernels to their op
    ops = _OpForest([e for e in events if e.get("ph") == "X" and e.get("cat") in host])
    steps = [i for i, e in enumerate(ops.events) if _STEP.match(e["name"])]
    if not steps:
        raise ValueError("the trace holds no ProfilerStep#N spans")
    device_work = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    totals, other = defaultdict(float), defaultdict(float)
    for step in steps:
        parts = _gpu_step(ops, step, device_work) if device_work else _cpu_step(ops, step)
        for (category, name), us in parts.items():
            totals[category] += us
            if category == "other":
                other[name[:200]] += us  # templated kernel names run to kilobytes
    n, step_us = len(steps), sum(ops.events[s]["dur"] for s in steps) / len(steps)
    return {
        "source": "cuda_compute_stream" if device_work else "cpu_main_thread",
        "steps": n,
        "step_s": step_us / 1e6,
        "seconds": {c: totals[c] / n / 1e6 for c in CATEGORIES},
        "other_names": {k: v / n / 1e6 for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:top_other]},
    }


class _OpForest:
    """CPU ops and record_function scopes nested per thread, with each op's category resolved through its
    enclosing scopes (and, for backward ops, through the forward op that created them)."""

    def __init__(self, events: list[dict]):
        self.events = sorted(events, key=lambda e: (e["pid"], e["tid"], e["ts"], -e["dur"]))
        self.parent = [-1] * len(self.events)
        self.children = defaultdict(list)
        stack: list[int] = []
        for i, e in enumerate(self.events):
            while stack and not self._contains(self.events[stack[-1]], e):
                stack.pop()
            if stack:
                self.parent[i] = stack[-1]
                self.children[stack[-1]].append(i)
            stack.append(i)
        # A kernel names its launch (runtime call) by correlation id; the launch nests in the op that made it.
        self.launch_by_correlation = {
            e["args"]["correlation"]: i
            for i, e in enumerate(self.events)
            if e["cat"] in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
        }
        self.forward_by_seq = defaultdict(list)
        for i, e in enumerate(self.events):
            seq = e.get("args", {}).get("Sequence number")
            if seq is not None and not self._is_backward(i):
                self.forward_by_seq[seq].append(i)
        self._category: dict[int, str | None] = {}

    @staticmethod
    def _contains(outer: dict, inner: dict) -> bool:
        return (outer["pid"], outer["tid"]) == (inner["pid"], inner["tid"]) and inner["ts"] < outer["ts"] + outer["dur"]

    def chain(self, i: int):
        while i != -1 and not _STEP.match(self.events[i]["name"]):
            yield i
            i = self.parent[i]

    def _is_backward(self, i: int) -> bool:
        return any(
            "Backward" in self.events[j]["name"] or "autograd::engine" in self.events[j]["name"] for j in self.chain(i)
        )

    def category(self, i: int) -> str | None:
        if i not in self._category:
            names = [self.events[j]["name"] for j in self.chain(i)]
            for j in self.chain(i):
                seq = self.events[j].get("args", {}).get("Sequence number")
                if seq is not None and "Backward" in self.events[j]["name"]:
                    names += [self.events[f]["name"] for k in self.forward_by_seq.get(seq, ()) for f in self.chain(k)]
            found = {classify(name) for name in names} - {None}
            self._category[i] = next((c for c in RULES if c in found), None)
        return self._category[i]


def _cpu_step(ops: _OpForest, step: int) -> dict[tuple[str, str], float]:
    """Self time of every op inside the step span; the span's own self time is idle."""
    parts = defaultdict(float)
    todo = [step]
    while todo:
        i = todo.pop()
        e = ops.events[i]
        end = e["ts"] + e["dur"]
        covered = sum(
            min(ops.events[c]["ts"] + ops.events[c]["dur"], end) - ops.events[c]["ts"] for c in ops.children[i]
        )
        category = "idle" if i == step else ops.category(i) or "other"
        parts[(category, e["name"])] += max(0.0, e["dur"] - covered)
        todo.extend(ops.children[i])
    return parts


def _gpu_step(ops: _OpForest, step: int, device_work: list[dict]) -> dict[tuple[str, str], float]:
    """The compute stream's time inside the step span: kernels by category, gaps by the exposed collective."""
    start, end = ops.events[step]["ts"], ops.events[step]["ts"] + ops.events[step]["dur"]
    in_step = [k for k in device_work if k["ts"] < end and k["ts"] + k["dur"] > start]
    busy = defaultdict(float)
    for k in in_step:
        if k["cat"] == "kernel" and not k["name"].startswith("nccl"):  # copies may fill a side stream for longer
            busy[k["args"].get("stream")] += k["dur"]
    compute_stream = max(busy, key=busy.get) if busy else None
    parts = defaultdict(float)
    compute, elsewhere = [], []
    for k in in_step:
        launch = ops.launch_by_correlation.get(k["args"].get("correlation"))
        if k["name"].startswith("nccl"):  # by its own name first: NCCL kernels say which collective they are
            category = classify(k["name"]) or (ops.category(launch) if launch is not None else None)
        else:  # the higher-priority of what its op and scopes say and what its own name says
            found = {ops.category(launch) if launch is not None else None, classify(k["name"], _KERNEL_PATTERNS)}
            category = next((c for c in RULES if c in found), None)
        category = category or "other"
        op = ops.parent[launch] if launch is not None else -1
        op_name = ops.events[op]["name"] if op != -1 else k["name"]
        name = k["name"] if op_name == k["name"] else f"{op_name} | {k['name']}"  # the op says more than a template
        span = (max(k["ts"], start), min(k["ts"] + k["dur"], end), category, name)
        if k["args"].get("stream") == compute_stream:
            compute.append(span)
        elif category in WAITED_ON:
            elsewhere.append(span)
    for i, e in enumerate(ops.events):  # an optimizer on a CPU thread (offload=full's host step) the GPU may wait for
        category = (
            ops.category(i)
            if e["cat"] in ("cpu_op", "user_annotation") and e["ts"] < end and e["ts"] + e["dur"] > start
            else None
        )
        if category in ("host_step", "optimizer"):
            elsewhere.append((max(e["ts"], start), min(e["ts"] + e["dur"], end), category, e["name"]))
    compute.sort()
    gaps, cursor = [], start
    for lo, hi, category, name in compute:
        if lo > cursor:
            gaps.append((cursor, lo))
        lo = max(lo, cursor)
        if hi > lo:
            parts[(category, name)] += hi - lo
            cursor = hi
    if end > cursor:
        gaps.append((cursor, end))
    # Idle stretches of the compute stream under a collective or an optimizer working elsewhere are its exposed
    # time (by priority).
    for category in WAITED_ON:
        covered, gaps = _cover(gaps, _union([(lo, hi) for lo, hi, c, _ in elsewhere if c == category]))
        parts[(category, category)] += covered
    parts[("idle", "idle")] += sum(hi - lo for lo, hi in gaps)
    return parts


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]


def _cover(gaps, covers) -> tuple[float, list[tuple[float, float]]]:
    """Sorted disjoint gaps against sorted disjoint covers: the time covered, and the gaps' uncovered pieces."""
    covered, remaining, j = 0.0, [], 0
    for lo, hi in gaps:
        while j < len(covers) and covers[j][1] <= lo:
            j += 1
        cursor, k = lo, j
        while k < len(covers) and covers[k][0] < hi:
            a, b = max(covers[k][0], cursor), min(covers[k][1], hi)
            if a > cursor:
                remaining.append((cursor, a))
            if b > a:
                covered += b - a
                cursor = b
            k += 1
        if hi > cursor:
            remaining.append((cursor, hi))
    return covered, remaining


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Break a torch.profiler Chrome trace down by category.")
    parser.add_argument("trace", help="trace .json or .json.gz with ProfilerStep#N spans")
    parser.add_argument("--top-other", type=int, default=15, help="how many 'other' names to list")
    args = parser.parse_args()
    print(json.dumps(breakdown(args.trace, args.top_other), indent=2))
