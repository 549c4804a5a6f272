"""The Hydra entry point: compose -> validate -> build -> loop -> record.

    python -m moe_lab.train                                   # tiny model on CPU, about a minute
    python -m moe_lab.train model=qwen3_30b model.num_layers=4 data.seq_len=8192 trainer.nproc_per_node=2 parallel.ep=2
    python -m moe_lab.train -m ac=full,selective              # a sweep: one result.json per point
"""

from __future__ import annotations

import atexit
import gc
import logging
import math
import os
import re
import resource
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from moe_lab import config as config_lib
from moe_lab.config import ConfigError
from moe_lab.config.validate import computes_in_bf16, runs_on_cuda
from moe_lab.launch.launcher import (
    adopt_slurm_environment,
    launch_local,
    rank_hydra_overrides,
    shared_run_dir,
    started_by_outer_launcher,
)
from moe_lab.metrics.flops import flops_per_token, peak_flops
from moe_lab.metrics.logger import NoLogger
from moe_lab.metrics.trace import StepProfiler
from moe_lab.models.checkpoint import load_hf_checkpoint
from moe_lab.models.qwen3_moe import count_parameters
from moe_lab.optim.host import local
from moe_lab.parallel import compile_loss, parallelize
from moe_lab.results.record import RESULT, MetricsLog, environment, failure, is_done, read_result, write_json_atomic

log = logging.getLogger("moe_lab")
config_lib.register()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> dict | None:
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    choices = {k: v for k, v in hc.runtime.choices.items() if not k.startswith("hydra")}
    meta = {"choices": choices, "overrides": list(hc.overrides.task), "sweep": hc.sweep.dir if multirun else None}
    return run_job(cfg, Path(hc.runtime.output_dir), meta, multirun=multirun)


def run_job(cfg: DictConfig, run_dir: Path, meta: dict, multirun: bool = False) -> dict | None:
    """One job (a single run or a sweep point). It ends with exactly one result.json by rank 0. In a sweep a failed
    point is recorded and returned, so Hydra's launcher goes on to the next point; a single run re-raises (exit
    code non-zero)."""
    adopt_slurm_environment()
    rank0 = os.environ.get("RANK", "0") == "0"
    done = multirun and cfg.trainer.skip_done and is_done(run_dir, meta["overrides"])
    if done and not started_by_outer_launcher():  # under an outer launcher the ranks decide together, in worker
        log.info("point already done, skipped: %s", run_dir)
        return read_result(run_dir)
    if rank0 and not done:
        (run_dir / RESULT).unlink(missing_ok=True)  # a failed earlier attempt of this point
    try:
        config_lib.validate(cfg)
    except ConfigError as e:
        if rank0:
            error = {"type": "ConfigError", "key": e.key, "message": str(e)}
            write_json_atomic(run_dir / RESULT, {**meta, "status": "invalid", "error": error, "config": OmegaConf.to_container(cfg)})
        if multirun:
            log.error("invalid config, point recorded and skipped: %s", e)
            return None
        sys.exit(f"invalid config: {e}")
    if cfg.trainer.dry_run:
        return dry_run(cfg)
    resolved = OmegaConf.to_yaml(cfg, resolve=True)
    result = None
    try:
        if cfg.trainer.nproc_per_node > 1 and not started_by_outer_launcher():
            result = launch_local(cfg.trainer.nproc_per_node, worker, resolved, str(run_dir), meta)
        else:
            result = worker(resolved, str(run_dir), meta)
    except Exception as e:
        if rank0 and not (run_dir / RESULT).exists():  # a rank died before rank 0 could record why
            write_json_atomic(run_dir / RESULT, {**meta, **failure(e)})
        if not multirun:
            raise
        log.error("point failed, recorded in %s: %s: %s", run_dir / RESULT, type(e).__name__, e)
    # The next point of a sweep runs in this process: free this one's model and host state (offload's reference
    # cycles, and a failed point's traceback once out of the except block) before it builds its own.
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        # Offload's pinned host buffers go back to PyTorch's pinned-block cache, which keeps them (tens of GiB)
        # for reuse; a next point with other sizes would pin beside them. (torch 2.13 made this public.)
        empty_host_cache = getattr(torch.accelerator, "empty_host_cache", None) or torch._C._host_emptyCache
        empty_host_cache()
    return result if result is not None else read_result(run_dir)


def dry_run(cfg: DictConfig) -> dict:
    model_cfg = instantiate(cfg.model)
    total, active = count_parameters(model_cfg)
    fpt = flops_per_token(model_cfg, cfg.data.seq_len)
    summary = {"total_params": total, "active_params": active, "flops_per_token": fpt["shared"]}
    print(
        f"{model_cfg.name} ({model_cfg.num_layers} layers): {total / 1e9:.2f}B total, {active / 1e9:.2f}B active "
        f"parameters; {fpt['shared'] / 1e9:.2f} GFLOP/token at seq {cfg.data.seq_len}"
    )
    return summary


def worker(resolved_yaml: str, run_dir: str, meta: dict) -> dict:
    """One rank of a job. Rank 0 writes metrics.jsonl and result.json; every failure is recorded before it is
    re-raised."""
    cfg = OmegaConf.create(resolved_yaml)
    run_dir = Path(run_dir)
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = _device(cfg.trainer, local_rank)
    if world > 1 and not dist.is_initialized():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=device if device.type == "cuda" else None)
        # One process group per process: the points of a sweep under torchrun share it, because initialising the
        # default group again on the launcher's store races (a rank can pick up the previous group's keys and hang).
        atexit.register(dist.destroy_process_group)
    if world > 1:
        run_dir = Path(shared_run_dir(str(run_dir)))
    if meta.get("sweep") and cfg.trainer.skip_done and is_done(run_dir, meta["overrides"]):
        # Reached under an outer launcher: every rank reads rank 0's run directory, so all ranks agree.
        log.info("point already done, skipped: %s", run_dir)
        return read_result(run_dir)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)  # a sweep runs its points in one process
    _reset_peak_host_rss()
    record = {**meta, "world_size": world, "config": OmegaConf.to_container(cfg), "environment": environment(device, world)}
    logger = instantiate(cfg.logger) if rank == 0 else NoLogger()
    logger.start(run_dir, record)
    result = {**record, "status": "error"}  # until the run says otherwise
    try:
        with StepProfiler(cfg.profile, run_dir, rank) as profiler:
            metrics = train(cfg, run_dir, device, rank, world, logger, profiler)
        if rank == 0:
            metrics["trace_breakdown"] = profiler.breakdown()
        result = {**record, "status": "ok", "error": None, "metrics": metrics}
    except Exception as e:
        result = {**record, **failure(e), "metrics": {"peak_gpu_mem_gib": _peak_gpu_gib(device)}}
        if rank == 0:
            write_json_atomic(run_dir / RESULT, result)
        raise
    finally:
        logger.finish(result)
    if rank == 0:
        write_json_atomic(run_dir / RESULT, result)
    if dist.is_initialized():
        # Ranks leave together: a gloo rank that exits (and tears its group down) while a peer still talks to it
        # can abort ("terminate called without an active exception"). Only successful jobs meet here; a failing rank
        # exits at once and its launcher stops the others.
        dist.barrier()
    return result


def train(
    cfg: DictConfig,
    run_dir: Path,
    device: torch.device,
    rank: int,
    world: int,
    logger: NoLogger = NoLogger(),
    profiler: StepProfiler = StepProfiler.off(),
) -> dict:
    model_cfg = instantiate(cfg.model)
    bf16 = computes_in_bf16(cfg.trainer)
    compute_dtype = torch.bfloat16 if bf16 else torch.float32
    model = build_model(cfg, device, rank, compute_dtype)
    optimizer = instantiate(cfg.offload).build(model, instantiate(cfg.optimizer), compute_dtype)
    data = instantiate(cfg.data)
    dp_rank = rank  # every rank is a data-parallel rank (EP borrows from dp_shard)
    autocast = torch.autocast(device.type, dtype=compute_dtype) if bf16 and world == 1 else nullcontext()

    loss_fn = compile_loss(lm_loss) if cfg.trainer.compile else lm_loss
    fpt = flops_per_token(model_cfg, cfg.data.seq_len)
    peak = peak_flops(device, cfg.trainer.peak_flops)
    tokens_per_step = cfg.data.batch_size * cfg.data.seq_len  # per rank
    metrics_log = MetricsLog(run_dir) if rank == 0 else None
    steps, step_times, losses = cfg.trainer.steps, [], []
    bar = tqdm(range(steps), desc="train", disable=rank != 0, dynamic_ncols=True, file=sys.stdout)
    for step in bar:
        start = time.perf_counter()
        lr = cfg.optimizer.lr * lr_factor(step, cfg.trainer)
        for group in optimizer.param_groups:
            group["lr"] = lr
        inputs, labels = (t.to(device, non_blocking=True) for t in data.batch(step, dp_rank))
        with autocast:
            logits = model(inputs)
        loss = loss_fn(logits, labels)
        loss.backward()
        grad_norm = clip_grad_norm(model, cfg.trainer.grad_clip) if cfg.trainer.grad_clip else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)  # gloo has no AVG
            loss = loss / world
        loss = loss.item()  # also waits for the step to finish, so the wall clock below is the step's time
        elapsed = time.perf_counter() - start
        step_times.append(elapsed)
        losses.append(loss)
        profiler.step()
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}")
        if metrics_log:
            row = {"step": step, "loss": loss, "lr": lr, "s_per_step": elapsed, "tokens_per_s_per_gpu": tokens_per_step / elapsed}
            if grad_norm is not None:
                row["grad_norm"] = grad_norm
            metrics_log.write(row)
            logger.log(row, step)
            bar.set_postfix(loss=f"{loss:.4f}", s_step=f"{elapsed:.3f}")
    if metrics_log:
        metrics_log.close()

    timed = step_times[cfg.trainer.timing_skip :] or step_times
    s_per_step = statistics.median(timed)
    tokens_per_s = tokens_per_step / s_per_step
    metrics = {
        "steps": steps,
        "final_loss": losses[-1],
        "first_loss": losses[0],
        "losses": losses,
        "s_per_step": s_per_step,
        "tokens_per_s_per_gpu": tokens_per_s,
        "mfu": tokens_per_s * fpt["shared"] / peak if peak else None,
        "mfu_executed": tokens_per_s * fpt["executed"] / peak if peak else None,
        "flops_per_token": fpt["shared"],
        "peak_gpu_mem_gib": _peak_gpu_gib(device),
        "peak_host_rss_gib": _peak_host_rss_gib(),
    }
    if rank == 0:
        print(summary_line(metrics))
    return metrics


def build_model(cfg: DictConfig, device: torch.device, rank: int, compute_dtype: torch.dtype) -> torch.nn.Module:
    """The configured model, parallelised, on ``device``: from ``trainer.init_checkpoint``, or initialised shard by
    shard from this rank's generator (DTensor's own random ops on CUDA draw every rank from rank 0's seed at each
    shard's offset in its tensor, which would give the experts of different EP ranks, separate tensors of one
    shape, the same values)."""
    torch.manual_seed(cfg.trainer.seed)
    with torch.device("meta"):
        model = instantiate(cfg.model).build()
    parallelize(model, cfg, device, compute_dtype)
    model.to_empty(device=device)
    if cfg.trainer.init_checkpoint:
        load_hf_checkpoint(model, cfg.trainer.init_checkpoint)
    else:
        torch.manual_seed(cfg.trainer.seed + rank)
        model.init_weights({name: local(p) for name, p in model.named_parameters()})
    return model


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def lr_factor(step: int, trainer) -> float:
    """Linear warmup to 1, then cosine decay to ``min_lr_ratio`` at the last step."""
    if step < trainer.warmup_steps:
        return (step + 1) / trainer.warmup_steps
    decay_steps = max(1, trainer.steps - trainer.warmup_steps - 1)
    progress = min(1.0, (step - trainer.warmup_steps) / decay_steps)
    return trainer.min_lr_ratio + (1 - trainer.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


@torch.no_grad()
def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global-norm clipping across every mesh: each gradient element lives on exactly one rank (dense weights are
    sharded over all ranks, experts split by EP and sharded over the rest), so local squared norms sum to the
    global one."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    shards = [local(g) for g in grads]
    total = torch.stack([g.float().pow(2).sum() for g in shards]).sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    norm = total.sqrt()
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(shards, scale)
    return norm.item()


def summary_line(m: dict) -> str:
    mfu = "n/a (CPU)" if m["mfu"] is None else f"{100 * m['mfu']:.1f}% (executed {100 * m['mfu_executed']:.1f}%)"
    gpu = "n/a" if m["peak_gpu_mem_gib"] is None else f"{m['peak_gpu_mem_gib']:.2f} GiB"
    return (
        f"done: loss {m['first_loss']:.4f} -> {m['final_loss']:.4f} | {m['s_per_step']:.3f} s/step | "
        f"{m['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU | MFU {mfu} | peak GPU mem {gpu} | "
        f"peak host RSS {m['peak_host_rss_gib']:.2f} GiB"
    )


def _device(trainer, local_rank: int) -> torch.device:
    if runs_on_cuda(trainer):  # validation has rejected trainer.device=cuda without CUDA
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _peak_gpu_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def _reset_peak_host_rss() -> None:
    """Restart the kernel's resident-set high-water mark (Linux), so that each point of a sweep run in one process
    reports its own peak; where that is not possible the peak is the process's so far."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def _peak_host_rss_gib() -> float:
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"^VmHWM:\s+(\d+) kB", status, re.M).group(1)) / 2**20
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


if __name__ == "__main__":
    sys.argv += rank_hydra_overrides()  # under torchrun / srun, ranks other than 0 leave no Hydra files
    main()
