"""Which FP8 kernels pay at the shapes the step really has (issue 42): one JSON record of GEMM times on this GPU.

    python experiments/fp8/kernel_probe.py --out RECORD.json --deep-gemm WHEEL [--deep-gemm WHEEL ...] \\
        --tvm-ffi WHEEL [--budget 500]

Three sections, each in its own subprocess (a section that crashes or runs out of time loses only its own points):

- ``base``: the experts' three GEMMs (fprop, dgrad, wgrad of gate/up and of down) in bf16 through
  ``torch._grouped_mm``, at the full-depth share (16 local experts x 8,192 rows: 16,384 tokens x top-8 over 16
  experts) and at 128 experts x 1,024 rows, for the 30B (hidden 2048, moe_intermediate 768) and 235B (4096 / 1536)
  widths.
- ``experts@<version>``, one per sgl-deep-gemm wheel, each installed in its own ``--target`` folder: the same GEMMs in
  blockwise FP8 (``m_grouped_fp8_gemm_nt_contiguous`` for fprop and dgrad, 1x128 rows x 128x128 weight blocks;
  ``k_grouped_fp8_gemm_nt_contiguous`` for wgrad, 1x128 tiles along the rows on both operands, accumulating into
  fp32) and in DeepGEMM's bf16 (m-grouped nt / nn, k-grouped tn). A wheel that does not import (built against another
  torch ABI) is recorded with its error.
- ``dense``: the block's attention projections (q, k|v, o) at 16,384 tokens, forward + backward of one linear with
  fp32 weights under bf16 autocast (one rank's training), every cast included: bf16; torchao float8 training
  (tensorwise and rowwise recipes, eager and compiled); torchao's blockwise prototype (``Float8BlockwiseLinear``,
  cuBLAS and Triton GEMMs); DeepGEMM's dense ``fp8_gemm_nt`` (1x128 x 128x128 for fprop and dgrad, 1x128 x 1x128
  for wgrad, in the first ``--deep-gemm`` wheel that imports) with torchao's Triton quantizers and moe_lab's
  weight-block kernel; and torchao's fused quantizer of the experts' weight-gradient operands into DeepGEMM's
  k-grouped FP8 layout (what FP8 weight gradients pay before their GEMM). ``--sections`` picks sections.

DeepGEMM compiles each kernel on first use (nvcc, seconds each): before a section is timed, ``--warm-workers``
processes make every first call in parallel into the section's own cache (DeepGEMM's JIT cache and Inductor's, both
written atomically), so the timed process finds them compiled. Every FP8 result is checked against the product of
its dequantized operands (``rel_err``: relative Frobenius error; blockwise FP8 with a bf16 output is about 1e-3).
Times are CUDA-event means over ``--iters`` calls after two warm-up calls; TFLOP/s count 2 x M x N x K.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# model: (hidden, moe_intermediate, heads, kv_heads); head_dim 128 (conf/model/qwen3_*.yaml)
MODELS = {"30b": (2048, 768, 32, 4), "235b": (4096, 1536, 64, 4)}
HEAD_DIM = 128
TOKENS = 16384
TOP_K = 8
# (local experts, rows per expert): one GPU's share at EP 8 (16 experts) and all 128 experts on one GPU
LAYOUTS = {"16x8192": (16, TOKENS * TOP_K // 16), "128x1024": (128, TOKENS * TOP_K // 128)}


def expert_gemms(hidden: int, inter: int) -> dict[str, tuple[str, int, int]]:
    """Each GEMM of a SwiGLU expert: name -> (kind, N, K) for fprop/dgrad ([rows, K] x [N, K]^T) and
    (kind, M, N) for wgrad ([M, rows] x [rows, N], the rows reduced)."""
    return {
        "fprop_gate_up": ("fprop", 2 * inter, hidden),
        "fprop_down": ("fprop", hidden, inter),
        "dgrad_down": ("dgrad", inter, hidden),
        "dgrad_gate_up": ("dgrad", hidden, 2 * inter),
        "wgrad_gate_up": ("wgrad", 2 * inter, hidden),
        "wgrad_down": ("wgrad", hidden, inter),
    }


def dense_linears(hidden: int, heads: int, kv_heads: int) -> dict[str, tuple[int, int]]:
    """The attention projections: name -> (in_features, out_features); k and v have one shape."""
    return {"q": (hidden, heads * HEAD_DIM), "kv": (hidden, kv_heads * HEAD_DIM), "o": (heads * HEAD_DIM, hidden)}


# ----------------------------------------------------------------------------------------------- in a section


@dataclass
class Timer:
    """``warm``: make each call once (the parallel JIT warm-up), else time it."""

    warm: bool
    iters: int

    def __call__(self, fn) -> float | None:
        import torch

        fn()
        if self.warm:
            torch.cuda.synchronize()
            return None
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(self.iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / self.iters


def rel_err(out, ref) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def fp8_rows(x):
    """[M, K] -> (e4m3, fp32 1x128 scales [M, K/128] MN-major: DeepGEMM's layout on SM90)."""
    from moe_lab.moe.fp8.quant import quantize_rows

    q, s = quantize_rows(x)
    return q, s.t().contiguous().t()


def fp8_k_grouped(x, groups: int):
    """[rows, mn] (groups of equal rows) -> DeepGEMM's k-grouped K-major operand: each group's [mn, rows_e]
    back to back (flat), scales per 128 rows [mn, rows / 128]; and the first group dequantized [rows_e, mn] (the
    reference's operand)."""
    import torch

    from moe_lab.moe.fp8.quant import FP8, FP8_MAX

    rows, mn = x.shape
    per = rows // groups
    tiles = x.float().view(rows // 128, 128, mn)
    scale = tiles.abs().amax(1) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # [rows / 128, mn]
    q = (tiles / scale[:, None, :]).to(FP8)
    first = (q[: per // 128].float() * scale[: per // 128, None, :]).view(per, mn)
    flat = q.view(groups, per, mn).transpose(1, 2).contiguous().view(-1)
    return (flat, scale.t()), first


def experts_points(kind: str):
    """(name, fields, fn(timer) -> fields) for every point of an expert section, in priority order: ``base`` is
    torch's bf16, ``experts`` DeepGEMM's FP8 then its bf16."""
    impls = ["bf16_torch"] if kind == "base" else ["fp8_deep_gemm", "bf16_deep_gemm"]
    points = []
    for impl in impls:
        for layout, (groups, per) in LAYOUTS.items():
            for model, (hidden, inter, *_) in MODELS.items():
                for gemm, (op, n, k) in expert_gemms(hidden, inter).items():
                    fields = dict(model=model, layout=layout, gemm=gemm, impl=impl, flops=2 * groups * per * n * k)
                    run = functools.partial(_expert_point, op=op, impl=impl, groups=groups, per=per, n=n, k=k)
                    points.append((f"{model}/{layout}/{gemm}/{impl}", fields, run))
    return points


def _expert_point(timer: Timer, op: str, impl: str, groups: int, per: int, n: int, k: int) -> dict:
    import torch

    from moe_lab.moe.fp8.quant import dequantize_blocks, dequantize_rows, quantize_blocks

    dev = "cuda"
    torch.manual_seed(0)
    rows = groups * per
    offs = torch.arange(1, groups + 1, device=dev, dtype=torch.int32) * per
    m_indices = torch.arange(groups, device=dev, dtype=torch.int32).repeat_interleave(per)
    ks = [per] * groups
    ks_t = torch.tensor(ks, device=dev, dtype=torch.int32)
    out: dict = {}
    if op in ("fprop", "dgrad"):
        # fprop: rows [R, K] x w[e] [N, K]^T; dgrad: the output gradient [R, N'] x w[e] [N', K'] where the stored
        # weight is [N', K'] = [K, N] (torch) or its blockwise-transposed copy [N, K] (FP8 nt)
        a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        if impl == "bf16_torch":
            w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) * 0.02
            if op == "fprop":
                out["ms"] = timer(lambda: torch._grouped_mm(a, w.transpose(-2, -1), offs=offs))
            else:  # w stored [K, N] as the layer keeps it: dx = dy @ w[e]
                wt = w.transpose(1, 2).contiguous()
                out["ms"] = timer(lambda: torch._grouped_mm(a, wt, offs=offs))
        elif impl == "bf16_deep_gemm":
            import deep_gemm

            d = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) * 0.02
            if op == "fprop":
                out["ms"] = timer(lambda: deep_gemm.m_grouped_bf16_gemm_nt_contiguous(a, w, d, m_indices))
            else:  # nn: b = the stored [K, N] weight
                wt = w.transpose(1, 2).contiguous()
                out["ms"] = timer(lambda: deep_gemm.m_grouped_bf16_gemm_nn_contiguous(a, wt, d, m_indices))
        else:  # fp8_deep_gemm: fprop and dgrad are the same nt call (dgrad on the transposed weight copy)
            import deep_gemm

            d = torch.empty(rows, n, device=dev, dtype=torch.bfloat16)
            w = torch.randn(groups, n, k, device=dev, dtype=torch.bfloat16) * 0.02
            a_q, a_s = fp8_rows(a)
            w_q, w_s = quantize_blocks(w)
            out["ms"] = timer(
                lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
                    (a_q, a_s), (w_q, w_s), d, m_indices, ensure_zero_padding=False
                )
            )
            if not timer.warm:  # the first expert's rows against its dequantized operands' product
                ref = dequantize_rows(a_q[:per], a_s[:per]) @ dequantize_blocks(w_q[:1], w_s[:1])[0].T
                out["rel_err"] = rel_err(d[:per], ref)
    else:  # wgrad: dW[e] [M=n, N=k] = g[rows_e]^T a[rows_e]
        g = torch.randn(rows, n, device=dev, dtype=torch.bfloat16)
        a = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        if impl == "bf16_torch":
            out["ms"] = timer(lambda: torch._grouped_mm(g.t(), a, offs=offs))
        elif impl == "bf16_deep_gemm":
            import deep_gemm

            d = torch.zeros(groups, n, k, device=dev, dtype=torch.float32)
            out["ms"] = timer(lambda: deep_gemm.k_grouped_bf16_gemm_tn_contiguous(g, a, d, ks, ks_t, c=d))
        else:
            import deep_gemm

            (g_q, g_s), g_ref = fp8_k_grouped(g, groups)
            (a_q, a_s), a_ref = fp8_k_grouped(a, groups)
            d = torch.zeros(groups, n, k, device=dev, dtype=torch.float32)
            # accumulating into fp32 as into a weight's fp32 gradient: no zeroing or cast in the step
            out["ms"] = timer(
                lambda: deep_gemm.k_grouped_fp8_gemm_nt_contiguous((g_q, g_s), (a_q, a_s), d, ks, ks_t, c=d)
            )
            if not timer.warm:
                d.zero_()
                deep_gemm.k_grouped_fp8_gemm_nt_contiguous((g_q, g_s), (a_q, a_s), d, ks, ks_t, c=d)
                out["rel_err"] = rel_err(d[0], g_ref.T @ a_ref)
    return out


def _k_grouped_quant_point(model: str, layout: str):
    """torchao's quantizer of a [rows, D] operand into DeepGEMM's k-grouped FP8 layout, for the four wgrad
    operands of a layer (dy and x: D = hidden; d_gate_up: 2 x inter; act: inter): ms for all four."""
    hidden, inter = MODELS[model][:2]
    groups, per = LAYOUTS[layout]
    fields = dict(model=model, layout=layout, gemm="wgrad_operands", impl="fp8_quant_torchao_k_grouped")

    def run(timer: Timer) -> dict:
        import torch
        from torchao.prototype.blockwise_fp8_training.deepgemm_quant import (
            _triton_fp8_blockwise_act_quant_k_grouped_deepgemm_with_group_sizes as quantize,
        )

        rows = groups * per
        ends = torch.arange(1, groups + 1, device="cuda", dtype=torch.int32) * per
        xs = [torch.randn(rows, d, device="cuda", dtype=torch.bfloat16) for d in (hidden, hidden, 2 * inter, inter)]
        return {"ms": timer(lambda: [quantize(x, ends, [per] * groups) for x in xs])}

    return f"{model}/{layout}/wgrad_operands/fp8_quant_torchao_k_grouped", fields, run


def dense_points():
    """(name, fields, fn) for every point of the dense section, in priority order: each linear's variants, as a
    step runs them first (compiled; DeepGEMM's, eager), then torchao's eager ones and its blockwise prototype (whose
    first calls can take minutes); then torchao's quantizer into DeepGEMM's k-grouped layout (what FP8 expert
    weight gradients would pay before their GEMM)."""
    points = []
    variants = ["bf16", "bf16_compiled", "torchao_tensorwise_compiled", "torchao_rowwise_compiled"]
    variants += ["deep_gemm_blockwise", "torchao_tensorwise", "torchao_rowwise"]
    variants += ["torchao_blockwise_triton", "torchao_blockwise"]
    for variant in variants:
        for model, (hidden, _, heads, kv_heads) in MODELS.items():
            for name, (fan_in, fan_out) in dense_linears(hidden, heads, kv_heads).items():
                fields = dict(model=model, linear=name, impl=variant, in_features=fan_in, out_features=fan_out)
                fields["flops"] = 3 * 2 * TOKENS * fan_in * fan_out  # fprop + dgrad + wgrad
                points.append((f"{model}/{name}/{variant}", fields, _dense_runner(variant, fan_in, fan_out)))
    return points + [_k_grouped_quant_point(model, layout) for layout in LAYOUTS for model in MODELS]


def _dense_runner(variant: str, fan_in: int, fan_out: int):
    def run(timer: Timer) -> dict:
        import torch
        from torch import nn

        torch.manual_seed(0)
        linear = nn.Linear(fan_in, fan_out, bias=False, device="cuda")  # fp32 master weight
        if variant.startswith("torchao_tensorwise") or variant.startswith("torchao_rowwise"):
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            recipe = "tensorwise" if "tensorwise" in variant else "rowwise"
            holder = convert_to_float8_training(
                nn.Sequential(linear), config=Float8LinearConfig.from_recipe_name(recipe)
            )
            module = holder[0]
        elif variant.startswith("torchao_blockwise"):
            from torchao.prototype.blockwise_fp8_training.linear import Float8BlockwiseLinear

            module = Float8BlockwiseLinear.from_float(linear)
            module.use_triton = variant.endswith("triton")
        elif variant == "deep_gemm_blockwise":
            module = deep_gemm_linear(linear)
        else:
            module = linear
        if variant.endswith("compiled"):
            module = torch.compile(module)
        x = torch.randn(TOKENS, fan_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(TOKENS, fan_out, device="cuda", dtype=torch.bfloat16)

        def step():
            linear.weight.grad = None
            x.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y = module(x)
            y.backward(grad)
            return y

        out = {"ms": timer(step)}
        if not timer.warm and variant not in ("bf16", "bf16_compiled"):  # against the bf16 product, same inputs
            y = step()
            got = (y.detach().clone(), x.grad.clone(), linear.weight.grad.clone())
            linear.weight.grad, x.grad = None, None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                y_ref = nn.functional.linear(x, linear.weight)
            y_ref.backward(grad)
            reference = (y_ref.detach(), x.grad, linear.weight.grad)
            out["rel_err"] = {key: rel_err(a, b) for key, a, b in zip(("y", "dx", "dw"), got, reference)}
        return out

    return run


@functools.cache
def _deep_gemm_blockwise():
    import deep_gemm
    import torch
    from torchao.prototype.blockwise_fp8_training.kernels import (
        triton_fp8_blockwise_act_quant_lhs,
        triton_fp8_blockwise_act_quant_transposed_lhs,
    )

    from moe_lab.moe.fp8.weights import quantize_expert_stack

    class DeepGemmBlockwise(torch.autograd.Function):
        """y = x w^T in DeepSeek-V3's blockwise FP8: x and dy in 1x128 tiles, w in 128x128 blocks (and its
        transpose, one pass), wgrad's dy^T and x^T in 1x128 tiles along the tokens, accumulated in fp32."""

        @staticmethod
        def forward(ctx, x, w):
            x = x.to(torch.bfloat16).contiguous()
            w_q, w_s, wt_q, wt_s = quantize_expert_stack(w[None])
            x_q, x_s = triton_fp8_blockwise_act_quant_lhs(x)
            y = torch.empty(x.shape[0], w.shape[0], device=x.device, dtype=torch.bfloat16)
            deep_gemm.fp8_gemm_nt((x_q, x_s), (w_q[0], w_s[0]), y)
            ctx.save_for_backward(x, wt_q[0], wt_s[0])
            return y

        @staticmethod
        def backward(ctx, dy):
            x, wt_q, wt_s = ctx.saved_tensors
            dy = dy.contiguous()
            dy_q, dy_s = triton_fp8_blockwise_act_quant_lhs(dy)
            dx = torch.empty_like(x)
            deep_gemm.fp8_gemm_nt((dy_q, dy_s), (wt_q, wt_s), dx)
            dyt = triton_fp8_blockwise_act_quant_transposed_lhs(dy)
            xt = triton_fp8_blockwise_act_quant_transposed_lhs(x)
            dw = torch.zeros(dy.shape[1], x.shape[1], device=x.device, dtype=torch.float32)
            deep_gemm.fp8_gemm_nt(dyt, xt, dw, c=dw, recipe=(1, 1, 128))
            return dx, dw

    return DeepGemmBlockwise.apply


def deep_gemm_linear(linear):
    import torch

    blockwise = _deep_gemm_blockwise()

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = linear

        def forward(self, x):
            return blockwise(x, self.inner.weight)

    return Module()


def run_section(args) -> None:
    """One section's points (all, or every ``--stride``-th from ``--start`` when warming), results to ``--out``."""
    import torch

    kind = args.section.split("@")[0]
    points = dense_points() if kind == "dense" else experts_points(kind)
    timer = Timer(warm=args.warm, iters=args.iters)
    deadline = time.monotonic() + args.seconds
    results = []
    for name, fields, fn in points[args.start :: args.stride]:
        if time.monotonic() > deadline:
            results.append({"point": name, **fields, "skipped": "section deadline"})
            continue
        row = {"point": name, **fields}
        began = time.monotonic()
        try:
            row.update(fn(timer))
            if row.get("ms") and row.get("flops"):
                row["tflops"] = round(row["flops"] / row["ms"] / 1e9, 1)
        except Exception as exc:  # recorded: an unsupported layout is an answer too
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        row["wall_s"] = round(time.monotonic() - began, 2)
        torch.cuda.empty_cache()
        results.append(row)
        if not args.warm:
            print(json.dumps(row), flush=True)
            Path(args.out).write_text(json.dumps(results, indent=1))
    Path(args.out).write_text(json.dumps(results, indent=1))


# ------------------------------------------------------------------------------------------------ the driver


def install(wheels: list[str], target: Path) -> str | None:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
         str(target), *wheels],
        capture_output=True, text=True,
    )  # fmt: skip
    return None if proc.returncode == 0 else proc.stderr[-1000:]


def section_env(site: Path | None, cache: Path) -> dict:
    env = dict(os.environ)
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join(paths + [str(ROOT), env.get("PYTHONPATH", "")])
    env["DG_JIT_CACHE_DIR"] = str(cache / "deep_gemm")
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache / "inductor")
    env["TRITON_CACHE_DIR"] = str(cache / "triton")
    return env


def run_child(section: str, env: dict, out: Path, seconds: float, iters: int, warm=False, start=0, stride=1):
    cmd = [sys.executable, __file__, "--section", section, "--out", str(out), "--seconds", str(int(seconds))]
    cmd += ["--iters", str(iters), "--start", str(start), "--stride", str(stride)] + (["--warm"] if warm else [])
    log = open(out.with_suffix(".log"), "w")  # noqa: SIM115  (the child's; closed with the process)
    return subprocess.Popen(cmd, env=env, stdout=log if warm else None, stderr=log)


def wait(proc: subprocess.Popen, seconds: float) -> str | None:
    """Wait for a child at most ``seconds``; kill it past that. -> why it failed, or None."""
    try:
        proc.wait(timeout=max(1.0, seconds))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return "killed at the section's time limit"
    return f"exit {proc.returncode}" if proc.returncode else None


def run_timed_section(section, env, workdir: Path, seconds: float, warm_workers: int, iters: int) -> list[dict]:
    """Warm the section's kernels in ``warm_workers`` parallel processes (first calls only: the JIT compiles),
    then time the section in one process."""
    began = time.monotonic()
    if warm_workers > 1:
        warm_s = 0.55 * seconds
        workers = [
            run_child(section, env, workdir / f"warm{i}.json", warm_s - 10, 1, True, i, warm_workers)
            for i in range(warm_workers)
        ]
        for proc in workers:
            wait(proc, warm_s - (time.monotonic() - began))
    out = workdir / "timed.json"
    left = seconds - (time.monotonic() - began)
    failed = wait(run_child(section, env, out, left - 10, iters), left)
    rows = json.loads(out.read_text()) if out.exists() else []
    if failed:
        log = out.with_suffix(".log").read_text()[-1500:]
        rows.append({"point": f"{section}/process", "error": f"{failed}: {log}"})
    for row in rows:
        row["section"] = section
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--deep-gemm", action="append", default=[], help="an sgl-deep-gemm wheel (repeatable)")
    parser.add_argument("--tvm-ffi", default=None, help="the apache-tvm-ffi wheel the 0.1/0.2.0-0.2.2 wheels need")
    parser.add_argument("--budget", type=float, default=500, help="seconds for the whole probe")
    parser.add_argument("--sections", default="base,experts,dense", help="which sections run (comma-separated)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warm-workers", type=int, default=8)
    parser.add_argument("--section", default=None, help=argparse.SUPPRESS)  # a child: one section
    parser.add_argument("--seconds", type=float, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--stride", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:
        run_section(args)
        return

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="kernel_probe_"))
    record: dict = {"argv": sys.argv[1:], "started_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}
    meta = subprocess.run(
        [sys.executable, "-c", "import torch, json; print(json.dumps({'torch': torch.__version__, 'cuda': "
         "torch.version.cuda, 'gpu': torch.cuda.get_device_name(), 'capability': torch.cuda.get_device_capability()}))"],
        capture_output=True, text=True,
    )  # fmt: skip
    record["machine"] = json.loads(meta.stdout) if meta.returncode == 0 else meta.stderr[-500:]
    record["shapes"] = {"models": MODELS, "layouts": LAYOUTS, "tokens": TOKENS}
    record["deep_gemm"], rows = {}, []

    def left() -> float:
        return args.budget - (time.monotonic() - began)

    def save() -> None:
        record["points"] = rows
        record["summary"] = summarize(rows)
        record["wall_s"] = round(time.monotonic() - began, 1)
        Path(args.out).write_text(json.dumps(record, indent=1))

    importable = []
    for wheel in args.deep_gemm:
        version = Path(wheel).name.split("-")[1]
        site = work / f"site-{version}"
        info = {"wheel": Path(wheel).name}
        info["install_error"] = install([wheel] + ([args.tvm_ffi] if args.tvm_ffi else []), site)
        if not info["install_error"]:
            check = subprocess.run(
                [sys.executable, "-c", "import deep_gemm; print(deep_gemm.__file__)"],
                env=section_env(site, work / f"cache-{version}"), capture_output=True, text=True,
            )  # fmt: skip
            info["imports"] = check.returncode == 0
            info["import_output"] = (check.stdout if check.returncode == 0 else check.stderr)[-800:]
            if info["imports"]:
                importable.append((version, site))
        record["deep_gemm"][version] = info
        print(f"sgl-deep-gemm {version}: {info.get('imports')} {info.get('import_output', '').strip()[-200:]}")
    save()

    # the sections, each given its share of what is left (base is quick: no JIT); DeepGEMM's dense GEMM in the
    # first wheel that imports (the pinned one comes first)
    chosen = args.sections.split(",")
    sections = [("base", None)] if "base" in chosen else []
    sections += [(f"experts@{v}", site) for v, site in importable] if "experts" in chosen else []
    if "dense" in chosen:
        sections.append(("dense", importable[0][1] if importable else None))
        record["dense_deep_gemm_version"] = importable[0][0] if importable else None
    for i, (section, site) in enumerate(sections):
        remaining = len(sections) - i
        share = left() / remaining if section != "base" else min(90.0, left() / remaining)
        if share < 30:
            rows.append({"point": f"{section}", "section": section, "skipped": "probe budget"})
            continue
        cache = work / f"cache-{section.replace('@', '-')}"
        workdir = work / section.replace("@", "-")
        workdir.mkdir(parents=True, exist_ok=True)
        print(f"== {section} ({share:.0f} s)", flush=True)
        warm = 0 if section == "base" else args.warm_workers  # base has no JIT kernels to warm
        rows += run_timed_section(section, section_env(site, cache), workdir, share, warm, args.iters)
        save()
    save()
    print(json.dumps(record["summary"], indent=1))


def summarize(rows: list[dict]) -> dict:
    """Per model/layout/GEMM: the fastest bf16 ms, each DeepGEMM version's FP8 ms and its speedup over that; per
    model/linear: each dense variant's ms and speedup over bf16."""
    experts: dict = {}
    for row in rows:
        if "gemm" not in row or not row.get("ms"):
            continue
        key = f"{row['model']}/{row['layout']}/{row['gemm']}"
        entry = experts.setdefault(key, {})
        version = row.get("section", "").partition("@")[2]
        label = row["impl"] + (f"@{version}" if version else "")
        entry[label] = {"ms": round(row["ms"], 4), "tflops": row.get("tflops")}
    for entry in experts.values():
        bf16 = [v["ms"] for k, v in entry.items() if k.startswith("bf16")]
        for k, v in entry.items():
            if k.startswith("fp8_deep_gemm") and bf16:
                v["speedup_over_fastest_bf16"] = round(min(bf16) / v["ms"], 3)
    dense: dict = {}
    for row in rows:
        if "linear" in row and row.get("ms"):
            dense.setdefault(f"{row['model']}/{row['linear']}", {})[row["impl"]] = {
                "ms": round(row["ms"], 4), "tflops": row.get("tflops"), "rel_err": row.get("rel_err")
            }  # fmt: skip
    for entry in dense.values():
        bf16 = min((entry[k]["ms"] for k in ("bf16", "bf16_compiled") if k in entry), default=None)
        for v in entry.values():
            if bf16:
                v["speedup_over_bf16"] = round(bf16 / v["ms"], 3)
    return {"experts": experts, "dense": dense}


if __name__ == "__main__":
    main()
