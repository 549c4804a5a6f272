"""MoE layer forward+backward on GPU: torch dispatcher vs fused dispatcher, at Qwen3-30B-A3B and Qwen3-235B-A22B
expert shapes (128 experts, or ``--experts``: 16 is the full-depth share's; top-8), several token counts per GPU,
balanced and skewed routing.

    python experiments/moe_layer/moe_layer.py --out /tmp/moe_layer_ep1.json                         # EP=1, one GPU
    python experiments/moe_layer/moe_layer.py --expert-precision fp8 --out /tmp/fp8.json  # + the fused op in FP8
    torchrun --nproc_per_node 2 experiments/moe_layer/moe_layer.py --out /tmp/moe_layer_ep2.json    # EP=2
    bash experiments/moe_layer/run.sh ep1|ep2                    # the study's runs, into its records/

Writes one JSON file: per point the median ms of forward+backward (CUDA events, max over ranks), TFLOP/s (FLOPs
from ``layer_flops``), the fused/torch speedup, and a per-kernel time breakdown from torch.profiler for the largest
balanced point of each model. A point that fails records its error instead of a time. ``--trace-dir DIR`` also
writes those points' profiles (CPU and GPU) as Chrome traces there: where the GPU waits on the host.
``--expert-precision fp8`` adds the fused dispatcher with its experts in blockwise FP8 (``fused_fp8``; its weight
copies made again every ``--micro-batches`` steps, default 1: one micro-batch per optimizer step, the worst case) and
each point's ``fp8_over_bf16`` (fused ms / fused_fp8 ms); ``--dispatchers`` picks which of them run. A point's ms is
per step, timed over whole optimizer steps of ``--micro-batches`` steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
from datetime import UTC, datetime

import torch
import torch.distributed as dist

from moe_lab.moe.dispatcher import FusedDispatcher, TorchDispatcher
from moe_lab.moe.experts import GroupedExperts
from moe_lab.moe.fp8 import weights as fp8_weights
from moe_lab.moe.router import Router
from moe_lab.parallel.expert_parallel import keep_local_experts
from moe_lab.results.record import git_state

MODELS = {"qwen3_30b": (2048, 768), "qwen3_235b": (4096, 1536)}
NUM_EXPERTS, TOP_K = 128, 8


def layer_flops(tokens: int, hidden: int, inter: int) -> float:
    """Forward: gate/up (2*H*2I) + down (2*I*H) per routed row = 6*H*I; backward twice that."""
    return 18.0 * tokens * TOP_K * hidden * inter


def build(hidden, inter, ep_rank, ep, num_experts=NUM_EXPERTS):
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts, hidden, inter)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, hidden**-0.5)
        experts.down_proj.normal_(0, inter**-0.5)
    keep_local_experts(experts, ep_rank, ep)
    return experts.to(device="cuda", dtype=torch.bfloat16)


def inputs(tokens, hidden, routing, rank, num_experts=NUM_EXPERTS):
    router = Router(hidden, num_experts, TOP_K, norm_topk_prob=True, routing=routing, seed=rank)
    ids = router.forced_ids(tokens, torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    weights = (
        torch.softmax(torch.randn(tokens, TOP_K, device="cuda", generator=gen), -1).to(torch.bfloat16).requires_grad_()
    )
    grad = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    return x, ids, weights, grad


def step(experts, dispatcher, x, ids, weights, grad, micro_batches: int = 1):
    """One optimizer step's micro-batches, forward + backward each. Fresh gradients each (as FSDP's reduce-scatter
    consumes them), so no accumulation kernel is timed; the FP8 copies are made once, as the optimizer step's
    in-place update would make them again."""
    fp8_weights._CACHE.clear()
    for _ in range(micro_batches):
        experts.zero_grad(set_to_none=True)
        x.grad = weights.grad = None
        dispatcher(x, ids, weights, experts.gate_up_proj, experts.down_proj).backward(grad)


def time_ms(fn, iters, warmup=3):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_breakdown(fn, top=15, trace: str | None = None, steps_per_call: int = 1):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if trace else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    rows = []
    for evt in prof.key_averages():
        device_us = getattr(evt, "self_device_time_total", 0) or getattr(evt, "self_cuda_time_total", 0)
        if device_us > 0:
            calls = 3 * steps_per_call
            rows.append(
                {"kernel": evt.key[:160], "ms_per_step": device_us / calls / 1e3, "calls_per_step": evt.count / calls}
            )
    rows.sort(key=lambda r: -r["ms_per_step"])
    return rows[:top]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="qwen3_30b,qwen3_235b")
    parser.add_argument("--tokens", default="4096,8192,16384", help="tokens per GPU")
    parser.add_argument("--routing", default="balanced,skewed")
    parser.add_argument("--gemm", default="auto", choices=["auto", "deep_gemm", "torch"])
    parser.add_argument("--expert-precision", default="bf16", choices=["bf16", "fp8"], help="fp8: add fused_fp8")
    parser.add_argument("--dispatchers", help="comma-separated subset of torch,fused,fused_fp8 (default: all built)")
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=1,
        help="steps per optimizer step (the FP8 weight copies made once in them)",
    )
    parser.add_argument(
        "--experts", type=int, default=NUM_EXPERTS, help="experts of the layer (16: the full-depth share's)"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace-dir", help="write the profiled points' CPU + GPU profiles here as Chrome traces")
    args = parser.parse_args()

    ep = int(os.environ.get("WORLD_SIZE", 1))
    group = None
    rank = 0
    if ep > 1:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
        group, rank = dist.group.WORLD, dist.get_rank()
    dispatchers = {
        "torch": TorchDispatcher().set_ep_group(group),
        "fused": FusedDispatcher(backend="gpu", gemm=args.gemm).set_ep_group(group),
    }
    if args.expert_precision == "fp8":
        dispatchers["fused_fp8"] = FusedDispatcher(backend="gpu", expert_precision="fp8").set_ep_group(group)
    if args.dispatchers:
        dispatchers = {name: dispatchers[name] for name in args.dispatchers.split(",")}

    points, breakdowns = [], []
    for model in args.models.split(","):
        hidden, inter = MODELS[model]
        layers = {name: (build(hidden, inter, rank, ep, args.experts), d) for name, d in dispatchers.items()}
        for routing in args.routing.split(","):
            for tokens in map(int, args.tokens.split(",")):
                x, ids, weights, grad = inputs(tokens, hidden, routing, rank, args.experts)
                point = {
                    "model": model,
                    "experts": args.experts,
                    "hidden": hidden,
                    "intermediate": inter,
                    "tokens_per_gpu": tokens,
                    "routing": routing,
                    "ep": ep,
                }
                for name, (experts, dispatcher) in layers.items():
                    fn = lambda: step(experts, dispatcher, x, ids, weights, grad, args.micro_batches)  # noqa: E731
                    try:
                        ms = time_ms(fn, args.iters) / args.micro_batches
                    except Exception as e:  # OOM, or a kernel error: the point records it
                        ms = float("nan")
                        point[f"{name}_error"] = repr(e)[:500]
                    torch.cuda.empty_cache()
                    if ep > 1:
                        t = torch.tensor([ms], device="cuda")
                        dist.all_reduce(t, op=dist.ReduceOp.MAX)
                        ms = t.item()
                    point[f"{name}_ms"] = ms
                    point[f"{name}_tflops"] = layer_flops(tokens, hidden, inter) / (ms * 1e-3) / 1e12
                    if (
                        args.profile
                        and ms == ms
                        and routing == "balanced"
                        and tokens == max(map(int, args.tokens.split(",")))
                    ):
                        trace = args.trace_dir and os.path.join(
                            args.trace_dir, f"{model}_{tokens}_{name}_rank{rank}.json"
                        )
                        if trace:
                            os.makedirs(args.trace_dir, exist_ok=True)
                        breakdowns.append(
                            {
                                "model": model,
                                "tokens_per_gpu": tokens,
                                "routing": routing,
                                "dispatcher": name,
                                "kernels": kernel_breakdown(fn, trace=trace, steps_per_call=args.micro_batches),
                            }
                        )
                if "torch_ms" in point and "fused_ms" in point:
                    point["speedup"] = point["torch_ms"] / point["fused_ms"]
                if "fused_ms" in point and "fused_fp8_ms" in point:
                    point["fp8_over_bf16"] = point["fused_ms"] / point["fused_fp8_ms"]
                points.append(point)
                if rank == 0:
                    print(json.dumps(point), flush=True)
        del layers
        torch.cuda.empty_cache()

    if rank == 0:
        record = {
            "command": "experiments/moe_layer/moe_layer.py " + " ".join(f"--{k}={v}" for k, v in vars(args).items()),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            **git_state(),
            "gpu": torch.cuda.get_device_name(),
            "num_gpus": ep,
            "torch": torch.__version__,
            "host": platform.node(),
            "fused_gemm": dispatchers["fused"].op_backend if "fused" in dispatchers else None,
            "points": points,
            "kernel_breakdown": breakdowns,
        }
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    if ep > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
