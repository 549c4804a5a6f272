"""Trace breakdown: on a real 2-rank CPU run (EP 2, FSDP 2) the parts sum to the measured step time within 5 % and
every category the run exercises is non-zero; the CUDA timeline logic on a hand-made trace; the H200 proxy run."""

from __future__ import annotations

import gzip
import json
import statistics
from pathlib import Path

import pytest
import torch

from moe_lab.metrics.trace import CATEGORIES, breakdown
from tests.cli import train_cli
from tests.sweep import ROOT


def profiled_run(run_dir: Path, *args: str) -> dict:
    args = [
        "trainer.steps=5",
        "profile.enabled=true",
        "profile.wait=1",
        "profile.warmup=1",
        "profile.active=2",
        f"hydra.run.dir={run_dir}",
        *args,
    ]
    proc = train_cli(*args, cwd=ROOT, timeout=600)  # forked: tests/cli.py
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    profiled = [r["s_per_step"] for r in rows if r["step"] in (2, 3)]  # wait 1 + warmup 1, then 2 active steps
    return result["metrics"]["trace_breakdown"] | {"measured_s": statistics.mean(profiled)}


def test_cpu_breakdown_sums_to_the_step_time(tmp_path):
    b = profiled_run(tmp_path, "trainer.nproc_per_node=2", "parallel.ep=2", "data.seq_len=32", "data.batch_size=2")
    assert b["source"] == "cpu_main_thread" and b["steps"] == 2 and set(b["seconds"]) == set(CATEGORIES)
    # A ProfilerStep span also holds the bookkeeping after the timed part of a step (metrics row, progress bar): a
    # few ms, several percent of these 30-70 ms CPU steps, more on a loaded machine.
    assert sum(b["seconds"].values()) == pytest.approx(b["measured_s"], rel=0.10)
    ran = (
        "dense_gemm",
        "expert_gemm",
        "attention",
        "dispatch_glue",
        "ep_all_to_all",
        "fsdp_all_gather",
        "fsdp_reduce_scatter",
        "optimizer",
        "idle",
    )
    assert all(b["seconds"][c] > 0 for c in ran), b["seconds"]
    assert b["other_names"] and all(v > 0 for v in b["other_names"].values())
    for rank in (0, 1):  # one Chrome trace per rank, readable by Perfetto / TensorBoard
        with gzip.open(tmp_path / f"trace_rank{rank}.json.gz", "rt") as f:
            assert any(e.get("name", "").startswith("ProfilerStep#") for e in json.load(f)["traceEvents"])


def _x(name, ts, dur, cat="cpu_op", tid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}


def launch(ts, correlation):
    return _x("cudaLaunchKernel", ts, 1, cat="cuda_runtime", correlation=correlation)


def test_cuda_timeline_by_kernel_scope_and_exposed_collective():
    events = [
        _x("ProfilerStep#3", 0, 100, cat="user_annotation"),
        _x("aten::mm", 10, 5),
        launch(11, 101),
        _x("moe_lab::dispatch", 20, 40, cat="user_annotation"),
        _x("aten::_grouped_mm", 25, 5),
        launch(26, 102),
        _x("aten::index", 35, 5),
        launch(36, 103),
        # kernels on the compute stream 7, collectives on streams 20 and 30
        _x("nvjet_tst_128x256", 12, 10, cat="kernel", tid=7, stream=7, correlation=101),
        _x("void cutlass_kernel", 30, 20, cat="kernel", tid=7, stream=7, correlation=102),
        _x("void index_elementwise_kernel", 50, 10, cat="kernel", tid=7, stream=7, correlation=103),
        _x("mystery_kernel", 80, 5, cat="kernel", tid=7, stream=7),
        _x("ncclDevKernel_SendRecv", 60, 15, cat="kernel", tid=20, stream=20),
        _x("ncclDevKernel_AllGather_RING_LL", 70, 20, cat="kernel", tid=30, stream=30),  # exposed only in 75-80
    ]
    b = breakdown(events)
    assert b["source"] == "cuda_compute_stream" and b["step_s"] == pytest.approx(100e-6)
    want = {
        "dense_gemm": 10,
        "expert_gemm": 20,
        "dispatch_glue": 10,
        "ep_all_to_all": 15,
        "fsdp_all_gather": 10,
        "other": 5,
        "idle": 30,
    }
    assert b["seconds"] == pytest.approx({c: want.get(c, 0) * 1e-6 for c in CATEGORIES})
    assert b["other_names"] == pytest.approx({"mystery_kernel": 5e-6})


def test_fused_op_kernels_split_into_expert_gemm_glue_and_exchange():
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("moe_lab::fused_moe", 10, 60),
        launch(11, 1),
        launch(12, 2),
        launch(13, 3),
        launch(14, 4),
        _x("gather_rows_kernel", 20, 10, cat="kernel", tid=7, stream=7, correlation=1),
        _x("void deep_gemm::sm90_bf16_gemm_impl<0u, 2048u>", 30, 20, cat="kernel", tid=7, stream=7, correlation=2),
        _x(
            "_ZN7cutlass13device_kernelINS_4gemm6kernel13GemmUniversalINS5_17GroupProblemShapeIN4cute",
            50,
            10,
            cat="kernel",
            tid=7,
            stream=7,
            correlation=3,
        ),
        _x(
            "c10d::symmetric_memory::barrier_kernel(unsigned int**, int)",
            60,
            5,
            cat="kernel",
            tid=7,
            stream=7,
            correlation=4,
        ),
    ]
    b = breakdown(events)
    want = {"dispatch_glue": 10, "expert_gemm": 30, "ep_all_to_all": 5, "idle": 55}
    assert b["seconds"] == pytest.approx({c: want.get(c, 0) * 1e-6 for c in CATEGORIES})


def test_compute_stream_waiting_on_offloaded_optimizer():
    """offload=optimizer: state copies fill a side stream for longer than the compute stream's kernels run: the
    compute stream's wait for them is exposed PCIe time; offload=full: the wait for a CPU thread's host step is
    exposed host-step time."""
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("aten::mm", 1, 2),
        launch(2, 1),
        _x("Optimizer.step#StreamedStateOptimizer.step", 40, 30, cat="user_annotation"),
        _x("aten::copy_", 41, 1),
        launch(41, 2),
        _x("nvjet_tst_128x256", 5, 20, cat="kernel", tid=7, stream=7, correlation=1),
        _x("Memcpy HtoD (Pinned -> Device)", 30, 40, cat="gpu_memcpy", tid=9, stream=9, correlation=2),
        # a CPU thread's host optimizer step while the compute stream idles
        _x("optimizer.host_step", 75, 15, cat="user_annotation", tid=2),
        _x("Optimizer.step#HostAdamW.step", 76, 13, cat="user_annotation", tid=2),
        _x("aten::_fused_adamw_", 77, 2, tid=2),
    ]
    b = breakdown(events)
    want = {"dense_gemm": 20, "pcie": 40, "host_step": 15, "idle": 25}
    assert b["seconds"] == pytest.approx({c: want.get(c, 0) * 1e-6 for c in CATEGORIES})


def test_exposed_host_step_and_pcie_traffic_apart_from_the_optimizer_wait():
    """The end of an offload=full step, by hand: the compute stream's last kernel, then a gradient copied device ->
    host on the compute stream; the worker thread steps the last chunk (its host step), then copies its weights host
    -> device on a side stream; the training thread waits in step() meanwhile, and past both. The compute stream's
    idle time goes to the host step while it runs, then to the copy, then to the optimizer's wait; the copy on the
    compute stream is PCIe time too."""
    events = [
        _x("ProfilerStep#2", 0, 100, cat="user_annotation"),
        _x("aten::mm", 1, 2),
        launch(2, 1),
        _x("aten::copy_", 3, 2),
        _x("cudaMemcpyAsync", 4, 1, cat="cuda_runtime", correlation=2),
        _x("Optimizer.step#InBackwardOptimizer.step", 20, 70, cat="user_annotation"),
        _x("optimizer.host_step", 30, 30, cat="user_annotation", tid=2),
        _x("Optimizer.step#HostAdamW.step", 30, 25, cat="user_annotation", tid=2),
        _x("aten::_fused_adamw_", 31, 5, tid=2),
        _x("aten::copy_", 56, 2, tid=2),
        _x("cudaMemcpyAsync", 57, 1, cat="cuda_runtime", tid=2, correlation=3),
        _x("nvjet_tst_128x256", 0, 18, cat="kernel", tid=7, stream=7, correlation=1),
        _x("Memcpy DtoH (Device -> Pinned)", 18, 2, cat="gpu_memcpy", tid=7, stream=7, correlation=2),
        _x("Memcpy HtoD (Pinned -> Device)", 55, 20, cat="gpu_memcpy", tid=9, stream=9, correlation=3),
    ]
    b = breakdown(events)
    want = {"dense_gemm": 18, "pcie": 2 + 15, "host_step": 30, "optimizer": 10 + 15, "idle": 10}
    assert b["seconds"] == pytest.approx({c: want.get(c, 0) * 1e-6 for c in CATEGORIES})


def test_backward_op_takes_the_scope_of_its_forward_op():
    events = [
        _x("ProfilerStep#1", 0, 100, cat="user_annotation"),
        _x("moe_lab::dispatch", 10, 20, cat="user_annotation"),
        _x("aten::index", 12, 10, **{"Sequence number": 7}),
        _x("autograd::engine::evaluate_function: IndexBackward0", 50, 30, **{"Sequence number": 7}),
        _x("IndexBackward0", 52, 26, **{"Sequence number": 7}),
        _x("aten::index_put_", 55, 20),
    ]
    b = breakdown(events)
    assert b["source"] == "cpu_main_thread"
    assert b["seconds"]["dispatch_glue"] == pytest.approx(50e-6)  # 20 forward (scope + op) + 30 backward
    assert b["seconds"]["idle"] == pytest.approx(50e-6)


@pytest.mark.gpu
def test_h200_proxy_breakdown_sums_to_the_step_time(tmp_path):
    b = profiled_run(
        tmp_path,
        "model=qwen3_30b",
        "model.num_layers=2",
        "model.routing=balanced",
        "data.seq_len=4096",
        "data.batch_size=1",
    )
    assert b["source"] == "cuda_compute_stream" and torch.cuda.is_available()
    assert sum(b["seconds"].values()) == pytest.approx(b["measured_s"], rel=0.05)
    assert all(b["seconds"][c] > 0 for c in ("dense_gemm", "expert_gemm", "attention", "optimizer")), b["seconds"]
