"""The external baseline of issue 6: torchtitan 0.2.2 (the release for torch 2.11) on moe_lab's Qwen3-MoE proxy.

Same proxy as moe_lab's runs: torchtitan's own Qwen3-30B-A3B (``--flavour 235B-A22B``: Qwen3-235B-A22B) with
``--layers`` layers (a flavour added at run time by
experiments/torchtitan_baseline/torchtitan_proxy.py), ``--batch-size`` packed samples (default 1) of ``seq`` tokens per GPU, forced balanced routing
(``debug.moe_force_load_balance``), compile on, FSDP2 over all GPUs with EP over all GPUs (EP2 on two), in each of
torchtitan's activation-checkpointing settings (``AC_SETTINGS``: none, full, op-level selective and its default
layer-level selective, every 2nd block; its ``memory_budget`` mode, a compiler partitioner knob with a budget to
tune, is left out). Each point is one torchtitan job, launched with
torchrun; rank 0's per-step log lines are parsed into one JSON file shaped like moe_lab's benchmark results. On one GPU
torchtitan applies no FSDP (dp_shard 1): it trains fp32 parameters under bf16 autocast; on two, FSDP2 keeps fp32
master weights and computes in bf16. Both are torchtitan's defaults, left as they are.

The GPU machines have no internet, so the assets torchtitan wants are built under ``--work-dir`` first: a word-level
``tokenizer.json`` over Qwen3's 151,936-id vocabulary (made with the ``tokenizers`` library) and a JSON-lines dataset
of random words, read by torchtitan's own text loader (``training.dataset=c4_test`` pointed at it with
``training.dataset_path``). Token content does not matter here: routing is forced.

Figures per point (median over steps ``--timing-from``..last): tokens/s/GPU as torchtitan logs it, s/step (tokens
per GPU per step / that), MFU by the shared formula and executed-FLOPs MFU (moe_lab.metrics.flops on the same
shapes, so ratios to moe_lab's results use identical FLOP counts; torchtitan's own MFU, the same formula, is kept as
``mfu_torchtitan`` to cross-check), and peak GPU memory as torchtitan logs it: ``max_reserved`` of the caching
allocator (moe_lab reports ``max_memory_allocated``, which is lower or equal).

Device command (nvidia-h200-x2; rebuild .whl/ first with ``bash scripts/fetch_wheels.sh``), one call per
sequence length, so that each call stays inside the 10-minute limit (a job's length is unmeasured yet: model build
and compile come before its 12 steps; ``--timeout`` cuts a job at 270 s)::

    run(kind="nvidia-h200-x2", carry=[".whl"], timeout_s=600, command="python3 -m pip install -q --no-index --no-deps
      --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit;
      export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1;
      python3 experiments/torchtitan_baseline/torchtitan_baseline.py --seq-lens 16384 --out $OUT/torchtitan_h200_seq16384.json")

then the same with ``--seq-lens 8192`` (``bash experiments/torchtitan_baseline/run.sh one_gpu|two_gpu|seq8192`` runs
the study's points into its records/, a part per call). The full default grid (seq 16384 and 8192 x 1 GPU and 2 GPUs
x the four AC settings, 12 steps each) is 16 jobs; ``--points`` narrows it, ``--dry-run`` builds the assets and
prints the torchrun commands. Each finished point is written at once, so a call cut short keeps them, and a job past
``--timeout`` is recorded as ``timeout`` while the next one starts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import statistics
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

from moe_lab.metrics.flops import flops_per_token, peak_bf16_flops
from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from moe_lab.results.record import git_state

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
# torchtitan's base flavour -> moe_lab's model conf with the same shapes (for the shared FLOP count)
MOE_LAB_MODEL = {"30B-A3B": "qwen3_30b", "235B-A22B": "qwen3_235b"}
# torchtitan's MetricsProcessor.log console line, colours off:
# "step:  5  loss:  9.12345  grad_norm:  1.2345  memory: 56.80GiB(40.11%)  tps: 49,300  tflops: 487.58  mfu: 49.30%"
# --points' AC names -> torchtitan's (activation_checkpoint.mode, selective_ac_option); records keep the name as "ac"
AC_SETTINGS = {
    "none": ("none", None),
    "full": ("full", None),
    "op-selective": ("selective", "op"),  # per op: saves matmuls (every other one) and attention, recomputes the rest
    "layer-selective": ("selective", "2"),  # torchtitan's default: full AC on every 2nd transformer block
}
STEP_LINE = re.compile(
    r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
    r"memory:\s*(?P<memory_gib>[\d.]+)GiB\([\d.]+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
    r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%"
)


def build_tokenizer(directory: Path, vocab_size: int) -> Path:
    """A word-level tokenizer whose ids cover the model's whole vocabulary: word ``t{i}`` is id i, id 0 is unknown."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def build_dataset(directory: Path, vocab_size: int, num_tokens: int, words_per_row: int = 4096, seed: int = 0) -> Path:
    """``train.jsonl`` of {"text": ...} rows of random words of the tokenizer above, ``num_tokens`` in all."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "train.jsonl", "w") as f:
        for start in range(0, num_tokens, words_per_row):
            words = (f"t{rng.randrange(1, vocab_size)}" for _ in range(min(words_per_row, num_tokens - start)))
            f.write(json.dumps({"text": " ".join(words)}) + "\n")
    return directory


def torchtitan_args(
    *,
    flavour: str,
    gpus: int,
    seq_len: int,
    ac: str,
    steps: int,
    compile: bool,
    assets: Path,
    data: Path,
    dump: Path,
    batch_size: int = 1,
) -> list[str]:
    args = [
        "--model.name",
        "qwen3",
        "--model.flavor",
        flavour,
        "--model.hf_assets_path",
        str(assets),
        "--experimental.custom_import",
        "torchtitan_proxy",
        "--training.dataset",
        "c4_test",
        "--training.dataset_path",
        str(data),
        "--training.local_batch_size",
        str(batch_size),
        "--training.seq_len",
        str(seq_len),
        "--training.steps",
        str(steps),
        "--lr_scheduler.warmup_steps",
        "2",
        "--parallelism.data_parallel_shard_degree",
        str(gpus),
        "--parallelism.expert_parallel_degree",
        str(gpus),
        *ac_args(ac),
        "--debug.moe_force_load_balance",
        "--metrics.log_freq",
        "1",
        "--metrics.disable_color_printing",
        "--job.dump_folder",
        str(dump),
    ]
    return args + (["--compile.enable"] if compile else [])


def ac_args(setting: str) -> list[str]:
    mode, option = AC_SETTINGS[setting]
    return ["--activation_checkpoint.mode", mode] + (
        ["--activation_checkpoint.selective_ac_option", option] if option else []
    )


def launch_command(gpus: int, args: list[str]) -> list[str]:
    """torchrun for any GPU count (torchtitan's trainer reads LOCAL_RANK); only rank 0's output, prefixed ``[rank0]:``."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}"]
    return torchrun + ["--local-ranks-filter=0", "--role=rank", "--tee=3", "-m", "torchtitan.train", *args]


def parse_steps(log: str) -> list[dict]:
    """Every step line of a torchtitan log, as numbers (the last one wins if a step is logged twice)."""
    steps: dict[int, dict] = {}
    for m in STEP_LINE.finditer(log):
        steps[int(m["step"])] = {
            "step": int(m["step"]),
            "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]),
            "memory_gib": float(m["memory_gib"]),
            "tps": float(m["tps"].replace(",", "")),
            "tflops": float(m["tflops"].replace(",", "")),
            "mfu": float(m["mfu"]) / 100,
        }
    return [steps[k] for k in sorted(steps)]


def summarize(
    steps: list[dict], *, tokens_per_gpu_step: int, timing_from: int, flops: dict[str, float] | None, peak: float | None
) -> dict:
    """Median of the steady-state steps (``step >= timing_from``); MFU by moe_lab's FLOP count where it is known."""
    timed = [s for s in steps if s["step"] >= timing_from]
    if not timed:
        return {"status": "error", "error_type": "NoSteadySteps", "error_message": f"no step >= {timing_from} logged"}
    tps = statistics.median(s["tps"] for s in timed)
    mfu = {k: (tps * flops[k] / peak if flops and peak else None) for k in ("shared", "executed")}
    return {
        "status": "ok",
        "steps_timed": [s["step"] for s in timed],
        "s_per_step": tokens_per_gpu_step / tps,
        "tokens_per_s_per_gpu": tps,
        "mfu": mfu["shared"],
        "mfu_executed": mfu["executed"],
        "mfu_torchtitan": statistics.median(s["mfu"] for s in timed),
        "peak_gpu_mem_reserved_gib": max(s["memory_gib"] for s in steps),
        "first_loss": steps[0]["loss"],
        "final_loss": steps[-1]["loss"],
        "losses": [s["loss"] for s in steps],
    }


def failure_status(log: str) -> tuple[str, str]:
    if "OutOfMemoryError" in log or "CUDA out of memory" in log:
        return "oom", "OutOfMemoryError"
    return "error", "TrainerFailed"


def moe_lab_flops(base: str, layers: int, seq_len: int, experts: int | None = None) -> dict[str, float] | None:
    if base not in MOE_LAB_MODEL:
        return None
    cfg = Qwen3MoeConfig.preset(MOE_LAB_MODEL[base], num_layers=layers, **({"num_experts": experts} if experts else {}))
    return flops_per_token(cfg, seq_len)


def hardware() -> dict:
    import torchtitan  # only the launcher needs it; the helpers above (and their tests) do not

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "torchtitan": getattr(torchtitan, "__version__", None),
        "peak_flops": peak_bf16_flops(gpu),
    }


def write_json(path: Path, payload: dict) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    tmp.replace(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="30B-A3B", help="torchtitan qwen3 MoE flavour the proxy is cut from")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--experts", type=int, help="routed experts (default: the flavour's); 16: one GPU's EP-8 share")
    parser.add_argument("--seq-lens", default="16384,8192")
    parser.add_argument("--batch-size", type=int, default=1, help="samples of seq tokens per GPU per step")
    parser.add_argument(
        "--points",
        default=",".join(f"{g}:{ac}" for g in (1, 2) for ac in AC_SETTINGS),
        help=f"GPUS:AC pairs, AC one of {', '.join(AC_SETTINGS)}",
    )
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--timing-from", type=int, default=5, help="first step in the median (compile, warm-up before)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--timeout", type=int, default=270, help="seconds per job")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/torchtitan_baseline"))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true", help="build the assets, print the commands, run nothing")
    args = parser.parse_args()

    from torchtitan.models.qwen3 import qwen3_args

    vocab_size = qwen3_args[args.flavour].vocab_size
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    points = [(int(g), ac) for g, ac in (p.split(":") for p in args.points.split(","))]
    if unknown := {ac for _, ac in points} - set(AC_SETTINGS):
        parser.error(f"--points: unknown AC setting(s) {sorted(unknown)}; one of {', '.join(AC_SETTINGS)}")
    assets = build_tokenizer(args.work_dir / "tokenizer", vocab_size)
    # enough tokens that no job re-loops the data (bos/eos are off: one word is one token)
    max_tokens = max(seq_lens) * args.batch_size * max(g for g, _ in points) * (args.steps + 1)
    data = build_dataset(args.work_dir / "data", vocab_size, max_tokens)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
        "HF_DATASETS_OFFLINE": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(args.work_dir / "hf"),
        "NCCL_NVLS_ENABLE": "0",
        "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
        "PYTHONUNBUFFERED": "1",
    }
    from torchtitan_proxy import EXPERT_COUNTS, proxy_flavour

    if args.experts is not None and args.experts not in EXPERT_COUNTS:
        parser.error(f"--experts: one of {', '.join(map(str, EXPERT_COUNTS))} (torchtitan_proxy.EXPERT_COUNTS)")
    flavour = proxy_flavour(args.flavour, args.layers, args.experts)
    out = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **git_state(),
        "hardware": hardware(),
        "proxy": {
            "torchtitan_flavour": flavour,
            "layers": args.layers,
            "experts": args.experts or qwen3_args[args.flavour].moe_args.num_experts,
            "local_batch_size": args.batch_size,
            "routing": "balanced (debug.moe_force_load_balance)",
            "compile": args.compile,
        },
        "timing": f"median of steps {args.timing_from}..{args.steps}",
        "points": [],
    }
    peak = out["hardware"]["peak_flops"]
    for seq_len in seq_lens:
        flops = moe_lab_flops(args.flavour, args.layers, seq_len, args.experts)
        for gpus, ac in points:
            name = f"seq{seq_len}_gpus{gpus}_{ac}"
            titan = torchtitan_args(
                flavour=flavour,
                gpus=gpus,
                seq_len=seq_len,
                ac=ac,
                steps=args.steps,
                compile=args.compile,
                assets=assets,
                data=data,
                dump=args.work_dir / "runs" / name,
                batch_size=args.batch_size,
            )
            command = launch_command(gpus, titan)
            mode, option = AC_SETTINGS[ac]
            point = {
                "gpus": gpus,
                "ep": gpus,
                "dp_shard": gpus,
                "seq_len": seq_len,
                "batch_size": args.batch_size,
                "ac": ac,
                "ac_mode": mode,
                "selective_ac_option": option,
                "command": shlex.join(command),
            }
            print(point["command"], flush=True)
            if args.dry_run:
                continue
            try:
                proc = subprocess.run(
                    command, check=False, env=env, capture_output=True, text=True, timeout=args.timeout
                )
                log, rc = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as e:
                log, rc = (e.stdout or b"").decode() + (e.stderr or b"").decode(), None
            (args.work_dir / f"{name}.log").write_text(log)
            steps = parse_steps(log)
            if rc == 0:
                point |= summarize(
                    steps,
                    tokens_per_gpu_step=seq_len * args.batch_size,
                    timing_from=args.timing_from,
                    flops=flops,
                    peak=peak,
                )
            else:
                status, error_type = ("timeout", "TimeoutExpired") if rc is None else failure_status(log)
                point |= {
                    "status": status,
                    "error_type": error_type,
                    "error_message": log[-3000:],
                    "losses": [s["loss"] for s in steps],
                }
            print(
                json.dumps({k: v for k, v in point.items() if k not in ("command", "losses", "error_message")}),
                flush=True,
            )
            out["points"].append(point)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_json(args.out, out)  # after every point: a job killed later leaves the earlier ones


if __name__ == "__main__":
    main()
