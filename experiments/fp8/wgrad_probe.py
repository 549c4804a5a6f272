"""Can the experts' weight gradients run in FP8 and pay? At the 30B and 235B expert shapes (128 experts, 1,024 rows
each: 16k tokens, top-8) this times, per weight-gradient GEMM of a layer (gate/up: dW = dGU^T X; down: dW = dY^T A):

- ``bf16``: today's ``torch._grouped_mm`` on the bf16 operands (k-grouped by the experts' row offsets);
- ``fp8_blockwise``: a Triton k-grouped FP8 GEMM on operands quantized per 128x1 tile along the rows (DeepSeek-V3's
  recipe for weight gradients: one fp32 scale per 128 rows of one column), written transposed (rows contiguous,
  the K-major layout Hopper's FP8 tensor cores read), with the quantization kernel's time beside it;
- ``fp8_rowwise``: ``torch._scaled_grouped_mm`` (2d x 2d, k-grouped) with one scale per expert and column (coarser:
  torchao's rowwise recipe), GEMM time only.

It checks each FP8 result against the fp32 product of the same dequantized operands and reports the error against
the bf16 product. Prints a table and writes a JSON record.

    python experiments/fp8/wgrad_probe.py --out experiments/fp8/records/h200_wgrad/<stamp>.json
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import UTC, datetime

import torch
import triton
import triton.language as tl

from moe_lab.moe.fp8.kernels import _quantize_tiles
from moe_lab.results.record import git_state

SHAPES = {"qwen3_30b": (2048, 768), "qwen3_235b": (4096, 1536)}  # hidden, expert intermediate
EXPERTS, ROWS_PER_EXPERT = 128, 1024


@triton.jit
def quantize_cols_t_kernel(x_ptr, q_t_ptr, scale_ptr, R, C: tl.constexpr):
    """x [R, C] -> e4m3 x^T [C, R] and scales [C, R / 128]: one scale per 128 rows of a column; one program per
    128x128 block, transposed in registers (rows contiguous in the copy); 8 warps (4 spill)."""
    rb, cb = tl.program_id(0), tl.program_id(1)
    r, c = tl.arange(0, 128), tl.arange(0, 128)
    x_ptr += (rb * 128).to(tl.int64) * C + cb * 128  # 64-bit block bases, 32-bit offsets inside (no spill)
    q_t_ptr += (cb * 128).to(tl.int64) * R + rb * 128
    vals = tl.load(x_ptr + r[:, None] * C + c[None, :]).to(tl.float32)
    q, scale = _quantize_tiles(tl.trans(vals))  # [cols, 128 rows]: a column's 128 rows are one tile
    tl.store(q_t_ptr + c[:, None] * R + r[None, :], q.to(tl.float8e4nv))
    tl.store(scale_ptr + (cb * 128 + c) * (R // 128) + rb, scale)


@triton.jit
def k_grouped_fp8_kernel(
    a_ptr, a_scale_ptr, b_ptr, b_scale_ptr, out_ptr, offs_ptr, R, N: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """out[e] [N, K] = sum over expert e's rows r of a[r, n] b[r, k], from a^T [N, R], b^T [K, R] in e4m3 with
    scales [N, R/128], [K, R/128]; each 128-row step's product scaled by its tiles' scales before it is added.
    Segments are 128-aligned; an expert without rows gets zeros."""
    e, pn, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
    end = tl.load(offs_ptr + e)
    n, k, r = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, 128)
    a_ptr += (pn * BM).to(tl.int64) * R  # 64-bit tile bases, 32-bit offsets inside (no spill)
    b_ptr += (pk * BN).to(tl.int64) * R
    a_scale_ptr += pn * BM * (R // 128)
    b_scale_ptr += pk * BN * (R // 128)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for row in tl.range(start, end, 128, num_stages=3):
        a = tl.load(a_ptr + n[:, None] * R + row + r[None, :])
        b = tl.load(b_ptr + k[None, :] * R + row + r[:, None])  # [128 rows, BN]: b^T read K-major
        sa = tl.load(a_scale_ptr + n * (R // 128) + row // 128)
        sb = tl.load(b_scale_ptr + k * (R // 128) + row // 128)
        acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
    out_ptr += e.to(tl.int64) * N * K + (pn * BM) * K + pk * BN
    tl.store(out_ptr + n[:, None] * K + k[None, :], acc.to(out_ptr.dtype.element_ty))


@triton.jit
def k_grouped_fp8_tma_kernel(
    a_desc, a_scale_ptr, b_desc, b_scale_ptr, out_ptr, offs_ptr, R, N: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr,
):  # fmt: skip
    """``k_grouped_fp8_kernel`` with its operand tiles loaded by TMA (tensor descriptors): no per-element pointers."""
    e, pn, pk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.where(e > 0, tl.load(offs_ptr + tl.maximum(e - 1, 0)), 0)
    end = tl.load(offs_ptr + e)
    n, k = tl.arange(0, BM), tl.arange(0, BN)
    a_scale_ptr += pn * BM * (R // 128)
    b_scale_ptr += pk * BN * (R // 128)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for row in tl.range(start, end, 128, num_stages=3):
        a = a_desc.load([pn * BM, row])
        b = b_desc.load([pk * BN, row])
        sa = tl.load(a_scale_ptr + n * (R // 128) + row // 128)
        sb = tl.load(b_scale_ptr + k * (R // 128) + row // 128)
        acc += tl.dot(a, b.T) * (sa[:, None] * sb[None, :])
    out_ptr += e.to(tl.int64) * N * K + (pn * BM) * K + pk * BN
    tl.store(out_ptr + n[:, None] * K + k[None, :], acc.to(out_ptr.dtype.element_ty))


def quantize_cols_t(x):
    rows, cols = x.shape
    q_t = torch.empty(cols, rows, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(cols, rows // 128, dtype=torch.float32, device=x.device)
    quantize_cols_t_kernel[(rows // 128, cols // 128)](x, q_t, scale, rows, cols, num_warps=8)
    return q_t, scale


def dequantize_cols_t(q_t, scale):  # -> fp32 [R, C]
    cols, rows = q_t.shape
    return (q_t.float().view(cols, rows // 128, 128) * scale[..., None]).view(cols, rows).t()


def k_grouped_fp8(a, b, offs, config):
    (a_t, sa), (b_t, sb) = a, b
    n, rows = a_t.shape
    k = b_t.shape[0]
    kind, bm, bn, warps = config
    out = torch.empty(offs.numel(), n, k, dtype=torch.bfloat16, device=a_t.device)
    grid = (offs.numel(), n // bm, k // bn)
    if kind == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        a_t = TensorDescriptor(a_t, list(a_t.shape), [rows, 1], [bm, 128])
        b_t = TensorDescriptor(b_t, list(b_t.shape), [rows, 1], [bn, 128])
        k_grouped_fp8_tma_kernel[grid](a_t, sa, b_t, sb, out, offs, rows, n, k, bm, bn, num_warps=warps)
    else:
        k_grouped_fp8_kernel[grid](a_t, sa, b_t, sb, out, offs, rows, n, k, bm, bn, num_warps=warps)
    return out


def rowwise_operands(g, x, offs):
    """torch._scaled_grouped_mm's 2d x 2d operands: g^T [N, R] row-major, x [R, K] column-major, e4m3, scaled per
    (expert, column) over the expert's rows."""
    experts, rows = offs.numel(), g.shape[0]
    per = rows // experts  # the probe's segments are equal

    def q(t):  # [R, C] -> e4m3 [R, C], scales [experts * C]
        v = t.float().view(experts, per, -1)
        s = v.abs().amax(1).clamp_min(1e-12) / 448.0
        return (v / s[:, None, :]).to(torch.float8_e4m3fn).view(rows, -1), s

    gq, gs = q(g)
    xq, xs = q(x)
    return gq.t().contiguous(), gs.reshape(-1), xq.t().contiguous().t(), xs.reshape(-1)


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    torch.cuda.synchronize()
    return start.elapsed_time(stop) / iters


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def probe_gemm(name, g, x, offs, configs):
    """One weight-gradient GEMM: out [E, N, K] = per-expert g^T x for g [R, N], x [R, K]."""
    flops = 2 * g.shape[0] * g.shape[1] * x.shape[1]
    point = {"gemm": name, "rows": g.shape[0], "n": g.shape[1], "k": x.shape[1], "tflop": flops / 1e12}
    bf16 = torch._grouped_mm(g.t(), x, offs=offs)
    point["bf16_ms"] = bench(lambda: torch._grouped_mm(g.t(), x, offs=offs))
    gq, xq = quantize_cols_t(g), quantize_cols_t(x)
    point["fp8_quantize_ms"] = bench(lambda: (quantize_cols_t(g), quantize_cols_t(x)))
    ga, xa = dequantize_cols_t(*gq), dequantize_cols_t(*xq)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    reference = torch.stack([ga[s:t].t() @ xa[s:t] for s, t in zip(starts, ends)])
    best = None
    for config in configs:
        try:
            out = k_grouped_fp8(gq, xq, offs, config)
            ms = bench(lambda config=config: k_grouped_fp8(gq, xq, offs, config))
        except Exception as e:  # a config that does not fit (shared memory, registers) is reported, not fatal
            print(f"  {name} fp8_blockwise {config}: {type(e).__name__}: {str(e)[:200]}")
            continue
        point.setdefault("fp8_blockwise_configs", {})[str(config)] = ms
        if best is None or ms < best[1]:
            best = (config, ms, out)
    if best is not None:
        point["fp8_blockwise_ms"], point["fp8_blockwise_config"] = best[1], list(best[0])
        point["fp8_blockwise_vs_dequantized"] = rel(best[2], reference)
        point["fp8_blockwise_vs_bf16"] = rel(best[2], bf16)
    try:
        gt, gs, xc, xs = rowwise_operands(g, x, offs)

        def rowwise():
            return torch._scaled_grouped_mm(gt, xc, gs, xs, offs=offs, out_dtype=torch.bfloat16)

        point["fp8_rowwise_vs_bf16"] = rel(rowwise(), bf16)
        point["fp8_rowwise_ms"] = bench(rowwise)
    except Exception as e:
        point["fp8_rowwise_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    for key in ("bf16", "fp8_blockwise", "fp8_rowwise"):
        if f"{key}_ms" in point:
            point[f"{key}_tflops"] = flops / point[f"{key}_ms"] / 1e9
    return point


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    configs = [(kind, *tile) for kind in ("tma", "pointers") for tile in ((128, 128, 4), (128, 128, 8), (128, 256, 8))]
    rows = EXPERTS * ROWS_PER_EXPERT
    offs = torch.arange(1, EXPERTS + 1, device=dev, dtype=torch.int32) * ROWS_PER_EXPERT
    points = []
    for model, (hidden, inter) in SHAPES.items():
        x = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16)
        d_gate_up = torch.randn(rows, 2 * inter, device=dev, dtype=torch.bfloat16) * 1e-3
        dy = torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16) * 1e-3
        act = torch.randn(rows, inter, device=dev, dtype=torch.bfloat16)
        for name, g, inp in (("gate_up", d_gate_up, x), ("down", dy, act)):
            point = {"model": model, **probe_gemm(name, g, inp, offs, configs)}
            points.append(point)
            print(json.dumps(point))
    for model in SHAPES:
        mine = [p for p in points if p["model"] == model]
        bf16 = sum(p["bf16_ms"] for p in mine)
        fp8 = sum(p.get("fp8_blockwise_ms", float("nan")) + p["fp8_quantize_ms"] for p in mine)
        print(f"{model}: both weight gradients bf16 {bf16:.3f} ms, fp8 blockwise with its quantization {fp8:.3f} ms")
    record = {
        "command": "python experiments/fp8/wgrad_probe.py",
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "host": platform.node(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **git_state(),
        "experts": EXPERTS,
        "rows_per_expert": ROWS_PER_EXPERT,
        "points": points,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
