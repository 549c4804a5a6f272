"""Probe sgl-deep-gemm's FP8 grouped GEMMs on this GPU: signatures, scale layouts, alignment, correctness against a
dequantized fp32 reference, and speed against the bf16 kernels. One run prints everything the fp8 path relies on.

    python experiments/fp8/probe.py
"""

from __future__ import annotations

import inspect

import deep_gemm
import torch
from deep_gemm import utils as dgu

torch.manual_seed(0)
dev = "cuda"
E4M3_MAX = 448.0
print("torch", torch.__version__, "cap", torch.cuda.get_device_capability(), "num_sms", deep_gemm.get_num_sms())
for name in (
    "m_grouped_fp8_gemm_nt_contiguous",
    "m_grouped_fp8_gemm_nn_contiguous",
    "k_grouped_fp8_gemm_tn_contiguous",
    "k_grouped_fp8_gemm_nt_contiguous",
    "k_grouped_bf16_gemm_tn_contiguous",
    "transform_sf_into_required_layout",
):
    print(name, inspect.signature(getattr(deep_gemm, name)))
print(
    "mk alignment",
    dgu.get_mk_alignment_for_contiguous_layout(),
    "tma aligned(1000,4)",
    dgu.get_tma_aligned_size(1000, 4),
)
print("utils:", [n for n in dir(dgu) if not n.startswith("_")])


def try_(label, fn):
    try:
        out = fn()
        print(f"[ok] {label}: {out}")
        return out
    except Exception as e:
        print(f"[FAIL] {label}: {type(e).__name__}: {str(e)[:600]}")
        return None


def rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def q_rows(x):  # 1x128 along the last dim: [M, K] -> fp8 [M, K], fp32 [M, K/128]
    m, k = x.shape
    v = x.float().view(m, k // 128, 128)
    s = v.abs().amax(-1).clamp_min(1e-4) / E4M3_MAX
    return (v / s[..., None]).to(torch.float8_e4m3fn).view(m, k), s


def dq_rows(q, s):
    m, k = q.shape
    return (q.float().view(m, k // 128, 128) * s[..., None]).view(m, k)


def q_blocks(w):  # 128x128 blocks: [G, N, K] -> fp8, fp32 [G, N/128, K/128]
    g, n, k = w.shape
    v = w.float().view(g, n // 128, 128, k // 128, 128)
    s = v.abs().amax(dim=(2, 4)).clamp_min(1e-4) / E4M3_MAX
    return (v / s[:, :, None, :, None]).to(torch.float8_e4m3fn).view(g, n, k), s


def dq_blocks(q, s):
    g, n, k = q.shape
    return (q.float().view(g, n // 128, 128, k // 128, 128) * s[:, :, None, :, None]).view(g, n, k)


def bench(fn, iters=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


# --- m-grouped forward: rows [M, K] x w [G, N, K] ------------------------------------------------------------------
G, N, K = 4, 384, 512
ms = [256, 0, 384, 128]  # one empty expert, all 128-aligned; then pad rows inside
M = sum(ms)
a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
w = torch.randn(G, N, K, device=dev, dtype=torch.bfloat16) * 0.05
m_idx = torch.cat([torch.full((m,), e, dtype=torch.int32, device=dev) for e, m in enumerate(ms)])
m_idx[250:256] = -1  # padding rows of expert 0
a[250:256] = 0
aq, asf = q_rows(a)
wq, wsf = q_blocks(w)
ref = torch.zeros(M, N, device=dev)
for e in range(G):
    sel = m_idx == e
    ref[sel] = dq_rows(aq, asf)[sel] @ dq_blocks(wq, wsf)[e].T
bf16ref = torch.zeros(M, N, device=dev)
for e in range(G):
    sel = m_idx == e
    bf16ref[sel] = a[sel].float() @ w[e].float().T
print("quant error of the reference vs bf16 (fwd):", rel(ref, bf16ref))

for label, sf in (("sfa K-major contiguous", asf), ("sfa via get_mn_major_tma_aligned_tensor", None)):

    def run_nt(sf=sf):
        if sf is None:
            sf = dgu.get_mn_major_tma_aligned_tensor(asf)
            print("   mn-major sf shape/stride", tuple(sf.shape), sf.stride())
        d = torch.zeros(M, N, device=dev, dtype=torch.bfloat16)
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous((aq, sf), (wq, wsf), d, m_idx)
        d = torch.where((m_idx >= 0)[:, None], d, torch.zeros_like(d))
        return f"rel vs ref {rel(d, ref):.2e}; pad rows |d| {float(d[250:256].abs().max()):.2e}"

    try_(f"m_grouped_fp8_gemm_nt_contiguous, {label}", run_nt)

# disable_ue8m0_cast explicitly, and what transform_sf does with fp32 scales on SM90
try_(
    "nt disable_ue8m0_cast=True",
    lambda: (
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
            (aq, asf),
            (wq, wsf),
            d := torch.zeros(M, N, device=dev, dtype=torch.bfloat16),
            m_idx,
            disable_ue8m0_cast=True,
        ),
        rel(torch.where((m_idx >= 0)[:, None], d, 0 * d), ref),
    )[1],
)


def tsf():
    t = deep_gemm.transform_sf_into_required_layout(asf, M, K, (1, 128, 128), None, True, False)
    t2 = deep_gemm.transform_sf_into_required_layout(t, M, K, (1, 128, 128), None, True, False)
    tb = deep_gemm.transform_sf_into_required_layout(wsf, N, K, (1, 128, 128), G, False, False)
    return (
        f"sfa {tuple(t.shape)} {t.stride()} {t.dtype}; again same ptr {t2.data_ptr() == t.data_ptr()}; "
        f"sfb {tuple(tb.shape)} {tb.stride()} same ptr {tb.data_ptr() == wsf.data_ptr()}"
    )


try_("transform_sf_into_required_layout (sfa, sfb)", tsf)

# --- input gradient: nn with w [G, N, K] (d[M, K] = g[M, N] @ w[e]) vs nt with a transposed quantized weight -------
g = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
g[250:256] = 0
gq, gsf = q_rows(g)
ref_nn = torch.zeros(M, K, device=dev)
for e in range(G):
    sel = m_idx == e
    ref_nn[sel] = dq_rows(gq, gsf)[sel] @ dq_blocks(wq, wsf)[e]


def run_nn():
    d = torch.zeros(M, K, device=dev, dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nn_contiguous((gq, gsf), (wq, wsf), d, m_idx)
    return rel(torch.where((m_idx >= 0)[:, None], d, 0 * d), ref_nn)


try_("m_grouped_fp8_gemm_nn_contiguous (w [G,N,K] as stored)", run_nn)


def run_nt_t():
    wtq = wq.transpose(1, 2).contiguous()  # the same 128x128 blocks, transposed: scales transpose too
    d = torch.zeros(M, K, device=dev, dtype=torch.bfloat16)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((gq, gsf), (wtq, wsf.transpose(1, 2).contiguous()), d, m_idx)
    return rel(torch.where((m_idx >= 0)[:, None], d, 0 * d), ref_nn)


try_("nt with transposed quantized weight", run_nt_t)

# --- weight gradients: k-grouped, K = rows of each expert ----------------------------------------------------------
# dW[e] [n, k] = g[rows_e]^T [n, r] @ a[rows_e] [r, k]; SM90 wants both K-major: per group [mn, r_e] contiguous.
ks = [256, 0, 384, 128]
Ktot = sum(ks)
ga = torch.randn(Ktot, N, device=dev, dtype=torch.bfloat16)  # gradient rows
xa = torch.randn(Ktot, K, device=dev, dtype=torch.bfloat16)  # input rows


def q_cols_grouped(
    x, ks
):  # per group: 128x1 tiles along rows; data [mn, r_e] per group back to back, sf [Ktot/128, mn]
    data, sfs, start = [], [], 0
    for r in ks:
        seg = x[start : start + r].float()
        v = seg.view(r // 128, 128, x.shape[1])
        s = v.abs().amax(1).clamp_min(1e-4) / E4M3_MAX  # [r/128, mn]
        q = (v / s[:, None, :]).to(torch.float8_e4m3fn).view(r, x.shape[1])
        data.append(q.T.contiguous().flatten())
        sfs.append(s)
        start += r
    return torch.cat(data), torch.cat(sfs)


def dq_cols_grouped(data, sf, ks, mn):
    rows, start, srow = [], 0, 0
    for r in ks:
        q = data[start * mn : (start + r) * mn].view(mn, r).T.float()
        s = sf[srow : srow + r // 128]
        rows.append((q.view(r // 128, 128, mn) * s[:, None, :]).view(r, mn))
        start += r
        srow += r // 128
    return torch.cat(rows)


gd, gs = q_cols_grouped(ga, ks)
xd, xs = q_cols_grouped(xa, ks)
gdq, xdq = dq_cols_grouped(gd, gs, ks, N), dq_cols_grouped(xd, xs, ks, K)
ref_w = torch.zeros(G, N, K, device=dev)
start = 0
for e, r in enumerate(ks):
    ref_w[e] = gdq[start : start + r].T @ xdq[start : start + r]
    start += r
ks_t = torch.tensor(ks, dtype=torch.int32, device=dev)
for fn_name in ("k_grouped_fp8_gemm_tn_contiguous", "k_grouped_fp8_gemm_nt_contiguous"):
    for c_label in ("c=d (accumulate into zeros)", "c=None"):

        def run_k(fn_name=fn_name, c_label=c_label):
            d = torch.zeros(G, N, K, device=dev, dtype=torch.float32)
            getattr(deep_gemm, fn_name)((gd, gs.T), (xd, xs.T), d, ks, ks_t, c=d if c_label.startswith("c=d") else None)
            return f"rel {rel(d, ref_w):.2e}; empty group |d| {float(d[1].abs().max()):.2e}"

        try_(f"{fn_name}, sf [mn, Ktot/128] .T views, {c_label}", run_k)


def run_k_bf16out():
    d = torch.zeros(G, N, K, device=dev, dtype=torch.bfloat16)
    deep_gemm.k_grouped_fp8_gemm_tn_contiguous((gd, gs.T), (xd, xs.T), d, ks, ks_t)
    return rel(d, ref_w)


try_("k_grouped tn, bf16 output", run_k_bf16out)


def run_k_wrong_host_ks():  # does it read the host list or the device tensor for the sizes?
    d = torch.zeros(G, N, K, device=dev, dtype=torch.float32)
    deep_gemm.k_grouped_fp8_gemm_tn_contiguous((gd, gs.T), (xd, xs.T), d, [Ktot // 4] * 4, ks_t, c=d)
    return rel(d, ref_w)


try_("k_grouped tn with a WRONG host ks (device ks right)", run_k_wrong_host_ks)
try_(
    "k_grouped tn with ks=[]",
    lambda: (
        deep_gemm.k_grouped_fp8_gemm_tn_contiguous((gd, gs.T), (xd, xs.T), torch.zeros(G, N, K, device=dev), [], ks_t)
        or "returned"
    ),
)


def run_kbf16():
    d = torch.zeros(G, N, K, device=dev, dtype=torch.float32)
    deep_gemm.k_grouped_bf16_gemm_tn_contiguous(ga, xa, d, ks, ks_t, c=d)
    ref_b = torch.stack([ga[s : s + r].float().T @ xa[s : s + r].float() for s, r in zip([0, 256, 256, 640], ks)])
    return rel(d, ref_b)


try_("k_grouped_bf16_gemm_tn_contiguous (a [Ktot, N], b [Ktot, K] MN-major)", run_kbf16)

# --- speed at the study's shapes: 128 experts, 16k tokens x top-8 balanced = 1024 rows each -----------------------
for H, I in ((2048, 768), (4096, 1536)):
    E, per = 128, 1024
    Mr = E * per
    xr = torch.randn(Mr, H, device=dev, dtype=torch.bfloat16)
    wg = torch.randn(E, 2 * I, H, device=dev, dtype=torch.bfloat16) * 0.02
    mi = torch.arange(E, device=dev, dtype=torch.int32).repeat_interleave(per)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * per
    xq, xsf = q_rows(xr)
    wgq, wgsf = q_blocks(wg)
    xsf_mn = dgu.get_mn_major_tma_aligned_tensor(xsf)
    out = torch.empty(Mr, 2 * I, device=dev, dtype=torch.bfloat16)
    flops = 2 * Mr * 2 * I * H
    t_bf = bench(lambda: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(xr, wg, out, mi))
    t_tg = bench(lambda: torch._grouped_mm(xr, wg.transpose(-2, -1), offs=offs))
    t_f8 = try_(
        f"H{H}: fp8 nt (mn-major sf)",
        lambda: bench(lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xsf_mn), (wgq, wgsf), out, mi)),
    )
    t_f8k = try_(
        f"H{H}: fp8 nt (k-major sf, as quantized)",
        lambda: bench(lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xsf), (wgq, wgsf), out, mi)),
    )
    print(
        f"H{H} gate_up fwd [{Mr}x{H}]x[{2 * I}x{H}]: bf16 dg {t_bf:.3f} ms ({flops / t_bf / 1e9:.0f} TF/s), torch "
        f"{t_tg:.3f} ms, fp8 {t_f8} ms ({flops / t_f8 / 1e9 if t_f8 else 0:.0f} TF/s), fp8 k-major sf {t_f8k}"
    )
    # wgrad of gate_up: dW [2I, H] per expert over 1024 rows
    ks_l = [per] * E
    kt = torch.tensor(ks_l, dtype=torch.int32, device=dev)
    g2 = torch.randn(Mr, 2 * I, device=dev, dtype=torch.bfloat16)
    d = torch.zeros(E, 2 * I, H, device=dev, dtype=torch.float32)
    gq2 = torch.empty(Mr * 2 * I, device=dev, dtype=torch.float8_e4m3fn)
    gs2 = torch.ones(Mr // 128, 2 * I, device=dev)
    xq2 = torch.empty(Mr * H, device=dev, dtype=torch.float8_e4m3fn)
    xs2 = torch.ones(Mr // 128, H, device=dev)

    def wgrad_fp8():  # as a step would run it: zero the fp32 accumulator, the GEMM, the cast to bf16
        d.zero_()
        deep_gemm.k_grouped_fp8_gemm_nt_contiguous((gq2, gs2.T), (xq2, xs2.T), d, ks_l, kt, c=d)
        return d.to(torch.bfloat16)

    t_wf8 = try_(f"H{H}: fp8 k-grouped nt wgrad (zero + gemm + cast)", lambda: bench(wgrad_fp8))
    t_wf8g = try_(
        f"H{H}: fp8 k-grouped nt wgrad, gemm alone",
        lambda: bench(lambda: deep_gemm.k_grouped_fp8_gemm_nt_contiguous((gq2, gs2.T), (xq2, xs2.T), d, ks_l, kt, c=d)),
    )
    t_wbf = try_(
        f"H{H}: bf16 k-grouped tn wgrad",
        lambda: bench(lambda: deep_gemm.k_grouped_bf16_gemm_tn_contiguous(g2, xr, d, ks_l, kt, c=d)),
    )
    t_wtg = bench(lambda: torch._grouped_mm(g2.t(), xr, offs=offs))
    print(
        f"H{H} wgrad: torch._grouped_mm {t_wtg:.3f} ms ({flops / t_wtg / 1e9:.0f} TF/s), fp8 {t_wf8} (gemm {t_wf8g}), bf16 dg {t_wbf}"
    )
    del xr, wg, xq, wgq, out, g2, d, gq2, xq2
    torch.cuda.empty_cache()
print("done")
