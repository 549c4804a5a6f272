"""``python -m moe_lab.plan.calibrate``: measure the rates the planner uses on this machine's GPU (bf16 GEMM, the
experts' grouped GEMM, causal attention forward + backward, device memory bandwidth, pinned host <-> device copies,
NCCL all-to-all when started by torchrun with more than one rank, offload=full's host AdamW step; DeepGEMM's FP8
grouped GEMM and precision=fp8's attention projection through torchao's float8 training where they run) and write a hardware profile the planner reads (``python -m moe_lab.plan
hardware=<profile.yaml>``).

Peaks cannot be measured: they come from a base profile (``--base``, by default the hardware group option named
after the GPU, else h200); each ``*_efficiency`` is a measured rate over its peak. What was not measured keeps the
base's value, and the file's header says which were. Without a GPU it runs the same code at tiny sizes on the CPU
(``--size tiny``, the default there), which checks the program, not the machine.

    python -m moe_lab.plan.calibrate --out conf/hardware/h200_measured.yaml          # one GPU
    torchrun --nproc-per-node 2 -m moe_lab.plan.calibrate --out /tmp/h200x2.yaml              # + all-to-all
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import time
from datetime import UTC, datetime
from pathlib import Path

import psutil
import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml

from moe_lab.metrics.flops import HARDWARE_CONF, hardware_option
from moe_lab.optim.offload.host_step import host_optimizer
from moe_lab.plan.hardware import GIB, Hardware
from moe_lab.plan.step_time import ATTENTION_REFERENCE_SEQ

# Sizes per --size: (GEMM side, expert rows per expert, experts, hidden, intermediate, seq, heads, head_dim,
# copy MiB, AdamW parameters, all-to-all MiB)
SIZES = {
    "full": dict(
        gemm=8192,
        rows=1024,
        experts=128,
        hidden=2048,
        inter=768,
        seq=ATTENTION_REFERENCE_SEQ,  # the sequence the planner takes attention's profile rate to be at
        heads=32,
        head_dim=128,
        copy_mib=2048,
        adamw=2**27,
        a2a_mib=256,
    ),
    "tiny": dict(
        gemm=256,
        rows=32,
        experts=8,
        hidden=64,
        inter=32,
        seq=256,
        heads=4,
        head_dim=16,
        copy_mib=16,
        adamw=2**18,
        a2a_mib=1,
    ),
}


def timed(fn, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of ``fn()`` after a warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gemm_flops(device, dtype, s) -> float:
    n = s["gemm"]
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / timed(lambda: a @ b, device)


def grouped_gemm_flops(device, dtype, s) -> float:
    """The experts' SwiGLU shape, forward and backward, balanced rows (what the dispatchers' grouped GEMMs run)."""
    e, rows, h, i = s["experts"], s["rows"], s["hidden"], s["inter"]
    x = torch.randn(e * rows, h, device=device, dtype=dtype, requires_grad=True)
    w1 = torch.randn(e, 2 * i, h, device=device, dtype=dtype, requires_grad=True)
    w2 = torch.randn(e, h, i, device=device, dtype=dtype, requires_grad=True)
    offs = torch.arange(1, e + 1, device=device, dtype=torch.int32) * rows

    grad = torch.randn(e * rows, h, device=device, dtype=dtype)  # a dense gradient: sum()'s is an expanded one

    def step():
        gate, up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs).backward(grad)

    return 3 * 2 * e * rows * 3 * h * i / timed(step, device)


def fp8_grouped_gemm_flops(device, s) -> float:
    """DeepGEMM's blockwise-FP8 m-grouped GEMM at the experts' gate/up shape, balanced rows: the FP8 experts'
    forward and input-gradient passes (``moe_lab.moe.fp8.grouped.deep_gemm_nt``)."""
    import deep_gemm

    from moe_lab.moe.fp8.quant import quantize_blocks, quantize_rows

    e, rows, h, i = s["experts"], s["rows"], s["hidden"], s["inter"]
    x_q, x_scale = quantize_rows(torch.randn(e * rows, h, device=device, dtype=torch.bfloat16))
    w = quantize_blocks(torch.randn(e, 2 * i, h, device=device, dtype=torch.bfloat16))
    m_indices = torch.arange(e, device=device, dtype=torch.int32).repeat_interleave(rows)
    out = torch.empty(e * rows, 2 * i, device=device, dtype=torch.bfloat16)
    a = (x_q, x_scale.t().contiguous().t())  # MN-major row scales, as the op hands them over
    return (
        2
        * e
        * rows
        * 2
        * i
        * h
        / timed(lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(a, w, out, m_indices), device)
    )


def fp8_dense_flops(device, s) -> float:
    """precision=fp8's attention projection as a step runs it: q_proj ([hidden -> heads x head_dim]) converted by
    ``Fp8Dense`` (its default recipe), compiled, its fp32 weight under bf16 autocast, forward and backward with every
    FP8 cast: 3 x 2 x tokens x in x out over that time."""
    from moe_lab.parallel.precision import Fp8Dense

    tokens, fan_in, fan_out = s["seq"], s["hidden"], s["heads"] * s["head_dim"]
    holder = torch.nn.Module()
    holder.self_attn = torch.nn.Module()  # the name Fp8Dense converts under
    holder.self_attn.q_proj = torch.nn.Linear(fan_in, fan_out, bias=False, device=device)
    Fp8Dense(linears=["q_proj"]).apply(holder)
    linear = torch.compile(holder.self_attn.q_proj)
    x = torch.randn(tokens, fan_in, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(tokens, fan_out, device=device, dtype=torch.bfloat16)

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            y = linear(x)
        y.backward(grad)

    return 3 * 2 * tokens * fan_in * fan_out / timed(step, device)


def attention_flops(device, dtype, s) -> float:
    """Causal SDPA forward + backward, executed FLOPs as the planner counts them (forward 2 * seq * heads * dim per
    token, backward 2.5x)."""
    shape = (1, s["heads"], s["seq"], s["head_dim"])
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    grad = torch.randn(shape, device=device, dtype=dtype)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return 3.5 * 2 * s["seq"] ** 2 * s["heads"] * s["head_dim"] / timed(step, device)


def copy_bytes_per_s(src: torch.Tensor, dst: torch.Tensor, device) -> float:
    return src.numel() * src.element_size() / timed(lambda: dst.copy_(src, non_blocking=True), device)


def host_adamw_params_per_s(s) -> float:
    """offload=full's host step as it runs (``moe_lab.optim.offload.host_step``: its C kernel over a bf16 gradient,
    the fp32 master and AdamW's moments, new weights back in bf16) on torch's threads (``calibrate`` sets the host
    step's default: the CPUs less one)."""
    master = torch.nn.Parameter(torch.zeros(s["adamw"]))
    optimizer = host_optimizer(functools.partial(torch.optim.AdamW, lr=1e-4, fused=True), [master])
    transfer = torch.randn(s["adamw"], dtype=torch.bfloat16)
    return s["adamw"] / timed(lambda: optimizer.step(transfer=transfer), torch.device("cpu"))


def host_memory_bytes_per_s(s) -> float:
    """The host's memory bandwidth as experiments/host_optimizer/host_optimizer.py takes its ceiling: the faster of two in-place
    streaming kernels (a scale, 8 bytes per element, and an add, 12), over tensors of the host step's size on torch's
    threads (as ``host_adamw_params_per_s``), so that the host step's share of it is taken like for like."""
    numel = s["adamw"]
    a, b = torch.randn(numel), torch.randn(numel)
    cpu = torch.device("cpu")
    return max(
        8 * numel / timed(lambda: a.mul_(1.0000001), cpu), 12 * numel / timed(lambda: a.add_(b, alpha=1e-7), cpu)
    )


def all_to_all_bytes_per_s(device, s) -> float:
    """Bytes each rank sends to its peers per second in ``all_to_all_single`` (the torch dispatcher's exchange)."""
    world = dist.get_world_size()
    numel = s["a2a_mib"] * 2**20 // 2
    x, out = (
        torch.randn(numel, device=device, dtype=torch.bfloat16),
        torch.empty(numel, device=device, dtype=torch.bfloat16),
    )
    seconds = timed(lambda: dist.all_to_all_single(out, x), device)
    return numel * 2 * (world - 1) / world / seconds


def base_profile(name: str | None, device: torch.device) -> dict:
    if name is None and device.type == "cuda":
        name = hardware_option(torch.cuda.get_device_name(device))
    values = yaml.safe_load((HARDWARE_CONF / f"{name or 'h200'}.yaml").read_text())
    values.pop("_target_")
    return values


def calibrate(size: str, base: str | None) -> tuple[dict, list[str]]:
    """-> (the profile's values, the keys measured)."""
    s = SIZES[size]
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    profile = base_profile(base, device)
    peak = Hardware(**profile)
    measured = {}

    def share(rate: float, of: float) -> float:
        return round(min(1.0, max(rate / of, 1e-6)), 6)

    flops = peak.peak_bf16_tflops * 1e12
    measured["dense_gemm_efficiency"] = share(gemm_flops(device, dtype, s), flops)
    measured["grouped_gemm_efficiency"] = share(grouped_gemm_flops(device, dtype, s), flops)
    measured["attention_efficiency"] = share(attention_flops(device, dtype, s), flops)
    if device.type == "cuda" and peak.peak_fp8_tflops and torch.cuda.get_device_capability(device) >= (9, 0):
        from moe_lab.runtime.device import deep_gemm_import_error

        if deep_gemm_import_error() is None:
            rate = fp8_grouped_gemm_flops(device, s)
            measured["fp8_grouped_gemm_efficiency"] = share(rate, peak.peak_fp8_tflops * 1e12)
    if device.type == "cuda" and peak.peak_fp8_tflops and torch.cuda.get_device_capability(device) >= (8, 9):
        if importlib.util.find_spec("torchao") is not None:
            measured["fp8_dense_gemm_efficiency"] = share(fp8_dense_flops(device, s), peak.peak_fp8_tflops * 1e12)
    big = torch.empty(s["copy_mib"] * 2**20 // 4, device=device)
    measured["hbm_efficiency"] = share(2 * copy_bytes_per_s(big, torch.empty_like(big), device), peak.hbm_tbps * 1e12)
    if device.type == "cuda":
        measured["hbm_gib"] = round(torch.cuda.get_device_properties(device).total_memory / GIB, 1)
        pinned = torch.empty(s["copy_mib"] * 2**20 // 4, pin_memory=True)
        measured["pcie_efficiency"] = share(copy_bytes_per_s(pinned, big, device), peak.pcie_gbps * 1e9)
    if dist.is_initialized() and dist.get_world_size() > 1:
        measured["nvlink_efficiency"] = share(all_to_all_bytes_per_s(device, s), peak.nvlink_gbps * 1e9)
    if not dist.is_initialized() or dist.get_rank() == 0:  # the host's rates as one process sees them, the node idle
        # torch's in-place streams are not a true ceiling: the host step kernel streams more than they do on some
        # hosts (H200 host: 149 against 114 GB/s; this project's VM at one thread: 28 against 24). The host moves at
        # least what its fastest measured stream moved, so that bounds its bandwidth from below.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))  # the host step's default: the CPUs less one
        host_step_bytes = host_adamw_params_per_s(s) * 32
        host_bw = max(host_memory_bytes_per_s(s), host_step_bytes)
        measured["host_memory_gbps"] = round(host_bw / 1e9, 1)
        measured["host_memory_gib"] = round(psutil.virtual_memory().total / GIB, 1)
        measured["host_adamw_efficiency"] = share(host_step_bytes, host_bw)
    profile.update(measured)
    profile["name"] = f"{profile['name']}_measured"
    Hardware(**profile)  # the profile the planner will build must be valid
    return profile, sorted(measured)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where to write the profile (yaml)")
    parser.add_argument(
        "--base", default=None, help="hardware option whose peaks to use (default: the GPU's, else h200)"
    )
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="full (default on a GPU) or tiny (default on CPU)"
    )
    args = parser.parse_args()
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    size = args.size or ("full" if torch.cuda.is_available() else "tiny")
    profile, measured = calibrate(size, args.base)
    if not dist.is_initialized() or dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        header = [
            f"# Written by python -m moe_lab.plan.calibrate --size {size} on {datetime.now(UTC):%Y-%m-%d %H:%M} UTC,",
            f"# {device}, torch {torch.__version__}, {int(os.environ.get('WORLD_SIZE', 1))} rank(s). Measured: {', '.join(measured)};",
            "# the peaks and every other key come from the base profile.",
        ]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        body = yaml.safe_dump({"_target_": "moe_lab.plan.hardware.Hardware", **profile}, sort_keys=False)
        Path(args.out).write_text("\n".join(header) + "\n" + body)
        print(f"profile: {args.out} (measured {', '.join(measured)})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
