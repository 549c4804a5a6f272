"""The whole training state through torch.distributed.checkpoint (DCP): every rank writes its pieces in parallel,
and any mesh shape reads them back (DCP reshards by each tensor's place in the whole one).

A checkpoint's DCP keys:

    model/<name>              each parameter, as this rank's piece of the whole parameter (``GlobalLayout``; the
                              replicas of HSDP hold the same pieces, written once)
    buffer/<name>             each persistent buffer (the routers' ``expert_bias`` under router_balance=bias): the
                              same on every rank (not sharded), written once and read whole by every rank
    optimizer/<name>/<key>    each parameter's optimizer state tensors: per-element ones laid out like the
                              parameter, scalars (AdamW's step count) as they are; offload=full adds each fp32 master
    optimizer_value/<name>/<key>  state that is not a tensor, pickled
    param_group/<name>        the hyperparameters of the parameter's group (the LR where the schedule left it, ...),
                              pickled, as are the objects below; for the record: a resumed run steps with its own
                              config's
    progress                  steps done, the loss of each, the held-out losses and the routers' statistics
                              summed over the run's steps and ranks
    rng/rank<r>, data/rank<r> each rank's random generators and data position (read back at the same world size,
                              whatever parallel.dp_replicate: rank r reads the same data at any); at another world
                              size the generators start afresh and every rank reads data/rank0 (a data position is
                              the global batch's, the same on every rank: ``DataSource.state_dict``)

The optimizer is read and restored through ``state_dict`` / ``load_state_dict`` in torch's format over the model's
parameters in order (the offload modes' optimizers give that too). One state key has a meaning here: ``master``, the
fp32 weights of an optimizer that keeps them apart from the model's (offload=full, whose model holds the compute
dtype's copy): offload=full's checkpoint restores its masters into the weights of a run without masters, another
mode's its fp32 model tensors into a run's masters; either way the fp32 weights, and no master carried on. Its state
per parameter is restored; its hyperparameters (LR, betas, weight decay, ...) stay those the run's config built it
with, and the LR schedule is not restored either (checkpoints written before hold a ``scheduler`` key, never read):
it is a function of the step, built after ``restore()`` at the step it returns, so a run continued with more steps
or other settings follows its own schedule from there. On disk a checkpoint is complete or absent
(``moe_lab.checkpoint.directory``).

A checkpoint is loaded only when it fits the run: its optimizer is the run's (the class its marker's config names,
``optimizer._target_``), every tensor the model has is in it, and it holds no model tensor, optimizer state or param
group of a parameter the model lacks (``CheckpointMismatch``, naming the key). One whose
files cannot be read back whole (a data file missing or cut short, its metadata or marker unreadable) is
``CheckpointDamaged``, naming the checkpoint and the file; ``trainer.resume=auto`` with ``trainer.resume_fallback``
sets it aside and loads the complete one before it.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import pickle
import random
import shutil
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from moe_lab.checkpoint import directory as ckpt_dir
from moe_lab.optim.offload import FullOffload
from moe_lab.optim.offload.full import MASTER
from moe_lab.parallel.emulate import is_emulated
from moe_lab.parallel.sharding import GlobalLayout, local_shard, shaped_like
from moe_lab.runtime.host_read import summed_over_ranks

log = logging.getLogger("moe_lab")
# Marks background saves complete once written, one at a time (a save waits for the one before).
_MARKER_THREAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-marker")


@dataclass
class Progress:
    """How far a run is: optimizer steps done, the loss of each, the held-out losses (``{"step", "loss"}``) and
    ``expert_load``, this rank's share of the routers' statistics summed over the steps (on its device; the
    trainer's ``ExpertLoad.total``), which the record reports for the whole run. A checkpoint holds it summed over
    the ranks; a resumed run's ranks split that so that their sum is it again, at any world size."""

    step: int = 0
    losses: list[float] = field(default_factory=list)
    eval_losses: list[dict] = field(default_factory=list)
    expert_load: torch.Tensor | None = None

    def advance(self, loss: float) -> None:
        self.step += 1
        self.losses.append(loss)


class CheckpointMismatch(ValueError):
    """A checkpoint that does not fit the run resuming from it; the message names the checkpoint and the key."""


class CheckpointDamaged(RuntimeError):
    """A checkpoint whose files cannot be read back whole; the message names the checkpoint and the file (where
    the failure names one), ``details`` both, for the run's record."""

    def __init__(self, checkpoint: Path, file: str | None, problem: str, advice: str = ""):
        where = f"{file}: " if file else ""
        super().__init__(f"checkpoint {checkpoint} is damaged: {where}{problem}{advice}")
        self.checkpoint, self.file, self.problem = checkpoint, file, problem
        self.details = {"checkpoint": str(checkpoint), "file": file}


class CheckpointWriteFailed(RuntimeError):
    """DCP failed writing a checkpoint (its ``CheckpointException`` is a BaseException, which a job's failure
    handling does not catch); the message names the checkpoint and each rank's error."""


class Checkpointer:
    """Saves and restores one run's training state; built once, after the model and optimizer (the LR schedule
    is built after ``restore()``, at the step it returns).

    ``restore()`` before the loop (where ``trainer.resume`` says), ``maybe_save(progress)`` after each step
    (every ``trainer.checkpoint.every`` steps), ``save(progress)`` on a signal, ``close()`` at the end (waits for a
    save still being written in the background). Every rank calls each of them at the same step.
    """

    def __init__(
        self,
        settings,
        resume: str,
        run_dir: str | Path,
        *,
        fallback: bool,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        data,
        device: torch.device,
        state_device: torch.device,
        config: dict,
        model_config: dict,
    ):
        self.every, self.keep, self.async_save = settings.every or 0, settings.keep, settings.async_save
        self.directory = ckpt_dir.checkpoint_dir(settings.dir, run_dir)
        self.resume, self.fallback = resume, fallback
        self.optimizer, self.data = optimizer, data
        self.device, self.state_device = device, state_device
        self.config, self.model_config = config, model_config
        self.layout = GlobalLayout(model)
        # Optimizer state is indexed by position in model.parameters(), as a torch optimizer built over them has it.
        self.names = [name for name, _ in model.named_parameters()]
        self.params = dict(model.named_parameters())
        self.buffers = persistent_buffers(model)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # Background saves talk over a group of their own: the training loop's collectives never interleave with them.
        self._group = dist.new_group(backend="gloo") if self.async_save and self.world > 1 else None
        self._pending: Future | None = None  # the background save being written, then marked complete
        self.resumed_from: Path | None = None
        self.set_aside: list[dict] = []  # damaged checkpoints restore() stepped over: what was wrong, where they went

    # ---- restore ----

    def restore(self) -> Progress:
        """Load the checkpoint ``trainer.resume`` names (auto: the newest complete one here, if any); the progress
        to continue from. Also clears what a killed run left half-written in the checkpoint directory.

        A damaged checkpoint raises ``CheckpointDamaged``; under ``auto`` with ``fallback`` it is set aside instead
        (renamed ``step_<N>.damaged``, so that this run writes that step afresh) and the one before it is loaded,
        with a warning; with none left before it, the run fails."""
        candidates = []
        if self.rank == 0:
            ckpt_dir.remove_leftovers(self.directory)
            if self.resume == "never":
                self._remove_earlier_run()
            if self.resume == "auto":
                candidates = ckpt_dir.complete(self.directory)[::-1]  # newest first
            elif self.resume != "never":
                candidates = [Path(self.resume)]
        candidates = _from_rank0(candidates)  # every rank reads the checkpoint rank 0 chose
        fallback = self.fallback and self.resume == "auto"
        for i, path in enumerate(candidates):
            try:
                progress = self._load_whole(path)
            except CheckpointDamaged as damaged:
                earlier = candidates[i + 1 :]
                if not (fallback and earlier):
                    raise CheckpointDamaged(path, damaged.file, damaged.problem, self._advice(earlier)) from damaged
                aside = _from_rank0(ckpt_dir.set_aside(path) if self.rank == 0 else None)
                self.set_aside.append(
                    {
                        "checkpoint": str(path),
                        "file": damaged.file,
                        "problem": damaged.problem,
                        "set_aside_as": str(aside),
                    }
                )
                if self.rank == 0:
                    log.warning(
                        "%s; set aside as %s, falling back to %s (trainer.resume_fallback)", damaged, aside, earlier[0]
                    )
                continue
            self.resumed_from = path
            log.info("resumed from %s at step %d", path, progress.step)
            return progress
        return Progress()

    def _advice(self, earlier: list[Path]) -> str:
        if self.resume != "auto":
            return " (named by trainer.resume)"
        if not earlier:
            return "; there is no complete checkpoint before it (trainer.resume=never starts afresh)"
        return f"; trainer.resume_fallback=true would set it aside and continue from {earlier[0]}"

    def _load_whole(self, path: Path) -> Progress:
        """``_load(path)``, or ``CheckpointDamaged`` on every rank when any rank found it damaged: rank 0 checks its
        files against its metadata first, then any rank's failure to read it counts."""
        problem = _from_rank0(find_damage(path) if self.rank == 0 else None)
        if problem is None:
            try:
                progress = self._load(path)
            except CheckpointException as e:  # DCP's, raised on every rank, holding each rank's error
                named = [getattr(error, "filename", None) for error, _ in e.failures.values()]
                file = _file_name(next(filter(None, named), None)) or _only_data_file(path)
                problem = (file, "reading it failed: " + _rank_errors(e))
            except (OSError, EOFError, pickle.UnpicklingError, json.JSONDecodeError) as e:  # one of its pickled objects
                file = _file_name(getattr(e, "filename", None)) or _only_data_file(path)
                problem = (file, f"reading it failed: {type(e).__name__}: {e}")
        problems = [problem]
        if dist.is_initialized():
            problems = [None] * self.world
            dist.all_gather_object(problems, problem)
        problem = next((p for p in problems if p is not None), None)
        if problem is not None:
            raise CheckpointDamaged(path, *problem)
        return progress

    def _load(self, path: Path) -> Progress:
        marker = ckpt_dir.read_marker(path)
        if why := optimizer_mismatch(marker, self.config):
            raise CheckpointMismatch(f"checkpoint {path}: optimizer: {why}")
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        same_world = marker["world_size"] == self.world
        current = self.optimizer.state_dict()
        position = {name: i for i, name in enumerate(self.names)}
        surplus = [key for key in saved if _split(key)[0] in PER_PARAMETER and _split(key)[1] not in position]
        if surplus:
            more = f" (and {len(surplus) - 1} more)" if len(surplus) > 1 else ""
            raise CheckpointMismatch(
                f"checkpoint {path}: {surplus[0]}{more} is the state of a parameter this model lacks (a checkpoint of "
                "another model, e.g. another model.num_layers?)"
            )
        target: dict = {}  # what DCP fills in place, by key
        # An optimizer that keeps fp32 masters apart from the weights (offload=full) and a checkpoint of one that
        # keeps none: the fp32 weights are the one's master and the other's model tensor, read into where this run
        # keeps them (the other tensor, in the compute dtype, is left unread, and no master is carried on).
        saved_masters = writer_kept_masters(marker)
        masters_from_weights: dict[str, torch.Tensor] = {}
        masters_into_weights: set[str] = set()
        for name in self.names:
            self._check_shape(path, saved, f"model/{name}", name)
            if f"param_group/{name}" not in saved:
                raise CheckpointMismatch(
                    f"checkpoint {path}: no param_group/{name}, the optimizer state of a parameter this model has"
                )
            weights = local_shard(self.params[name]).detach()
            master = current["state"].get(position[name], {}).get(MASTER)
            saved_master = f"optimizer/{name}/{MASTER}"
            has_master = saved_masters and saved_master in saved
            if master is not None and not has_master:
                masters_from_weights[name] = local_shard(master).detach()
                target[f"model/{name}"] = self.layout.view(name, masters_from_weights[name])
            elif master is None and has_master:
                masters_into_weights.add(name)
                target[saved_master] = self.layout.view(name, weights)
            else:
                target[f"model/{name}"] = self.layout.view(name, weights)
        for name, buffer in self.buffers.items():
            key = f"buffer/{name}"
            if key not in saved:
                raise CheckpointMismatch(f"checkpoint {path}: no {key} (written with another model.router_balance?)")
            if tuple(saved[key].size) != tuple(buffer.shape):
                raise CheckpointMismatch(
                    f"checkpoint {path}: {key} has shape {tuple(saved[key].size)}, this model's is {tuple(buffer.shape)}"
                )
            target[key] = buffer  # loaded in place
        per_rank = {f"rng/rank{self.rank}", f"data/rank{self.rank}"} if same_world else {"data/rank0"}
        for key, meta in saved.items():
            kind, name, state_key = _split(key)
            if kind in OBJECTS:
                if kind not in PER_RANK or f"{kind}/{name}" in per_rank:
                    target[key] = torch.empty(meta.size, dtype=torch.uint8)
                continue
            if kind == "buffer" and name not in self.buffers:
                raise CheckpointMismatch(
                    f"checkpoint {path}: {key} is a buffer this model lacks (another model.router_balance?)"
                )
            if kind != "optimizer" or key in target or (state_key == MASTER and not saved_masters):
                continue
            if len(meta.size) == 0:  # a scalar (AdamW's step count)
                target[key] = torch.empty((), dtype=meta.properties.dtype)
                continue
            self._check_shape(path, saved, key, name)
            existing = current["state"].get(position[name], {}).get(state_key)
            if torch.is_tensor(existing) and existing.dtype == meta.properties.dtype:
                local = local_shard(existing).detach()  # loaded in place (offload=full's masters)
            else:
                local = torch.empty(
                    self.layout.local_shape(name), dtype=meta.properties.dtype, device=self.state_device
                )
            target[key] = self.layout.view(name, local)
        with torch.no_grad():
            dcp.load(target, checkpoint_id=str(path), planner=_load_planner(), no_dist=not dist.is_initialized())

        state = {position[n]: {MASTER: shaped_like(self.params[n], m)} for n, m in masters_from_weights.items()}
        for key, value in target.items():
            kind, name, state_key = _split(key)
            if kind == "optimizer" and state_key == MASTER and name in masters_into_weights:
                continue
            if kind == "optimizer":
                value = shaped_like(self.params[name], local_shard(value)) if value.dim() > 0 else value
            elif kind == "optimizer_value":
                value = _unpickled(value)
            else:
                continue
            state.setdefault(position[name], {})[state_key] = value
        # The groups this run's config built (not the checkpoint's): a resume with another optimizer.lr (or betas,
        # ...) steps with those.
        self.optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})
        if same_world:
            _set_rng_state(_unpickled(target[f"rng/rank{self.rank}"]), self.device)
            self.data.load_state_dict(_unpickled(target[f"data/rank{self.rank}"]))
        else:
            self.data.load_state_dict(_unpickled(target["data/rank0"]))
            log.info(
                "checkpoint %s was written by %d ranks, this run has %d: random generator states start afresh, the "
                "data position goes on from rank 0's",
                path,
                marker["world_size"],
                self.world,
            )
        progress = _unpickled(target["progress"])
        if "eval_losses" not in progress:
            log.warning(
                "checkpoint %s predates held-out losses and expert load in checkpoints: the record's cover the steps "
                "from %d on",
                path,
                progress["step"],
            )
        expert_load = progress.get("expert_load")
        if expert_load is not None:
            expert_load = self._share(torch.tensor(expert_load, dtype=torch.float64, device=self.device))
        return Progress(progress["step"], list(progress["losses"]), list(progress.get("eval_losses", [])), expert_load)

    def _share(self, total: torch.Tensor) -> torch.Tensor:
        """This rank's share of a sum over the ranks, the shares summing to it exactly: all of it on rank 0; an
        emulated rank's peers mirror it, so there each holds 1 / world of it."""
        if is_emulated():
            return total / self.world
        return total if self.rank == 0 else torch.zeros_like(total)

    def _check_shape(self, path: Path, saved: dict, key: str, name: str) -> None:
        if key not in saved:
            raise CheckpointMismatch(f"checkpoint {path}: no {key} (a checkpoint of another model?)")
        if tuple(saved[key].size) != tuple(self.layout.shape(name)):
            raise CheckpointMismatch(
                f"checkpoint {path}: {key} has shape {tuple(saved[key].size)}, this model's is {tuple(self.layout.shape(name))}"
            )

    def _remove_earlier_run(self) -> None:
        """``trainer.resume=never`` starts the directory afresh: the checkpoints an earlier run left here go, else
        this run's would be pruned beside their higher steps, one at a step they hold would not be written (its
        step is "already there"), and ``resume=auto`` would later find theirs, not this run's."""
        earlier = ckpt_dir.complete(self.directory)
        for path in earlier:
            ckpt_dir.remove(path)
        if earlier:
            log.warning(
                "trainer.resume=never: removed the %d checkpoint(s) an earlier run left in %s (the newest: %s)",
                len(earlier),
                self.directory,
                earlier[-1].name,
            )

    # ---- save ----

    def maybe_save(self, progress: Progress) -> None:
        if self.every and progress.step % self.every == 0:
            self.save(progress, background=self.async_save)

    def save(self, progress: Progress, background: bool = False) -> Path:
        """Write a checkpoint of ``progress.step``; returns where it is (complete once written and marked)."""
        self._wait()
        final = ckpt_dir.complete_path(self.directory, progress.step)
        if _from_rank0(final.exists()):  # this step's state is already there (a run that resumed from it)
            return final
        partial = ckpt_dir.partial_path(self.directory, progress.step)
        # background: a host copy of the state is taken now, the files are written by a thread of DCP's
        state = self._state_dict(progress, copy=background)
        self._check_disk_space(state, final)
        if background:
            written = dcp.async_save(
                state,
                checkpoint_id=str(partial),
                planner=_save_planner(),
                process_group=self._group,
                no_dist=not dist.is_initialized(),
                async_stager=_AlreadyCopied(),
            )
            self._pending = _MARKER_THREAD.submit(self._finish_when_written, written, progress.step)
        else:
            try:
                dcp.save(state, checkpoint_id=str(partial), planner=_save_planner(), no_dist=not dist.is_initialized())
            except CheckpointException as e:
                raise CheckpointWriteFailed(f"checkpoint {final}: writing it failed: {_rank_errors(e)}") from e
            self._finish(progress.step)
        return final

    def _check_disk_space(self, state: dict, final: Path) -> None:
        """Refuse to start a checkpoint the disk cannot hold, on every rank, before anything is written: a write that
        runs out of space fails inside DCP with a message that names neither (and the complete checkpoints before
        it, and the run's record, stay as they are). The checkpoint's size is its tensors' bytes over all ranks
        (every rank writes into the one directory), plus ``DISK_HEADROOM`` for DCP's metadata and the marker."""
        needed = sum(_gathered(state_bytes(state))) + DISK_HEADROOM
        problem = None
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.directory).free
            if free < needed:
                problem = (
                    f"not enough disk space for checkpoint {final.name} in {self.directory}: it needs {needed:,} bytes "
                    f"({needed / 2**30:.2f} GiB), the file system has {free:,} bytes ({free / 2**30:.2f} GiB) free. "
                    "Free space there, point trainer.checkpoint.dir elsewhere or lower trainer.checkpoint.keep; "
                    "then run the same command again to resume from the last complete checkpoint."
                )
        problem = _from_rank0(problem)
        if problem:
            raise NotEnoughDiskSpace(problem)

    def close(self) -> None:
        """Wait for a background save to be written and marked complete."""
        self._wait()

    def _state_dict(self, progress: Progress, copy: bool = False) -> dict:
        """The state as DCP saves it; ``copy``: its tensors copied to host memory (else the live ones)."""

        def piece(t: torch.Tensor) -> torch.Tensor:
            t = local_shard(t).detach()
            return t.to("cpu", copy=True) if copy else t

        state: dict = {f"model/{name}": self.layout.view(name, piece(p)) for name, p in self.params.items()}
        state |= {f"buffer/{name}": piece(b) for name, b in self.buffers.items()}
        optimizer = self.optimizer.state_dict()
        for position, entries in optimizer["state"].items():
            name = self.names[position]
            for key, value in entries.items():
                if not torch.is_tensor(value):
                    state[f"optimizer_value/{name}/{key}"] = _pickled(value)
                elif value.dim() == 0:  # a scalar (AdamW's step count)
                    state[f"optimizer/{name}/{key}"] = piece(value)
                else:
                    local = piece(value)
                    if local.shape != self.layout.local_shape(name):
                        raise ValueError(
                            f"optimizer state {key!r} of {name} is not shaped like the parameter: {tuple(local.shape)}"
                        )
                    state[f"optimizer/{name}/{key}"] = self.layout.view(name, local)
        for group in optimizer["param_groups"]:
            hyperparameters = _pickled({k: v for k, v in group.items() if k != "params"})
            for position in group["params"]:
                state[f"param_group/{self.names[position]}"] = hyperparameters
        state["progress"] = _pickled(
            {
                "step": progress.step,
                "losses": list(progress.losses),
                "eval_losses": list(progress.eval_losses),
                "expert_load": None
                if progress.expert_load is None
                else summed_over_ranks(progress.expert_load).tolist(),
            }
        )
        state[f"rng/rank{self.rank}"] = _pickled(_rng_state(self.device))
        state[f"data/rank{self.rank}"] = _pickled(self.data.state_dict())
        return state

    def _finish(self, step: int) -> None:
        """Every rank's data is on disk (DCP's save returns once rank 0 has written the metadata after all ranks'
        writes): rank 0 marks the checkpoint complete and prunes old ones."""
        if self.rank != 0:
            return
        partial, final = ckpt_dir.partial_path(self.directory, step), ckpt_dir.complete_path(self.directory, step)
        marker = {
            "step": step,
            "world_size": self.world,
            "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__,
            "model": self.model_config,
            "config": self.config,
        }
        (partial / ckpt_dir.MARKER).write_text(json.dumps(marker, indent=2, default=str))
        partial.rename(final)
        ckpt_dir.prune(self.directory, self.keep)
        log.info("checkpoint: %s", final)

    def _finish_when_written(self, written: Future, step: int) -> None:
        written.result()
        self._finish(step)

    def _wait(self) -> None:
        """Wait for the background save; its failure is raised here, on the training thread."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                pending.result()
            except CheckpointException as e:
                message = f"a checkpoint in {self.directory}: writing it in the background failed: {_rank_errors(e)}"
                raise CheckpointWriteFailed(message) from e


class NotEnoughDiskSpace(OSError):
    """A checkpoint the checkpoint directory's file system has no room for; the message names both and the bytes."""


DISK_HEADROOM = 64 * 2**20  # DCP's metadata file, the marker, file-system blocks: generous for any model here


def state_bytes(state: dict) -> int:
    """Bytes of this rank's share of the tensors in a state to save: a DTensor's local piece, over the ranks that
    hold the same piece (HSDP's replicas: DCP writes a replicated piece once, spreading the pieces over them)."""
    total = 0
    for value in state.values():
        if isinstance(value, DTensor):
            copies = math.prod(value.device_mesh.size(d) for d, p in enumerate(value.placements) if p.is_replicate())
            total += value.to_local().numel() * value.to_local().element_size() // copies
        elif torch.is_tensor(value):
            total += value.numel() * value.element_size()
    return total


def _gathered(value: int) -> list[int]:
    if not dist.is_initialized():
        return [value]
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def persistent_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers ``model.state_dict()`` holds (training state that is no parameter), by name."""
    saved = model.state_dict(keep_vars=True)
    return {name: buffer for name, buffer in model.named_buffers() if name in saved}


def find_damage(path: Path) -> tuple[str, str] | None:
    """(file, what is wrong) for a checkpoint whose files cannot be read back whole, else None: its marker or DCP
    metadata unreadable, or a data file its metadata places tensors in missing or shorter than where they end."""
    try:
        ckpt_dir.read_marker(path)
    except (OSError, ValueError) as e:
        return ckpt_dir.MARKER, f"unreadable ({type(e).__name__}: {e})"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # a pickle cut short or overwritten raises whatever unpickling its bytes meets
        return ckpt_dir.DCP_METADATA, f"unreadable ({type(e).__name__}: {e})"
    ends: dict[str, int] = {}  # data file -> where the last tensor placed in it ends
    for item in metadata.storage_data.values():
        ends[item.relative_path] = max(ends.get(item.relative_path, 0), item.offset + item.length)
    for name, end in sorted(ends.items()):
        if not (path / name).is_file():
            return name, "missing"
        size = (path / name).stat().st_size
        if size < end:
            return name, f"cut short: {size} bytes, its tensors run to byte {end}"
    return None


def _file_name(path) -> str | None:
    return Path(path).name if path else None


def _only_data_file(path: Path) -> str | None:
    """A one-rank checkpoint's one data file: where a read that failed without naming its file failed."""
    files = list(path.glob("*.distcp"))
    return files[0].name if len(files) == 1 else None


def _rank_errors(e: CheckpointException) -> str:
    """Each rank's error, its first line (torch.load's unpickling errors run on for lines of advice)."""
    return "; ".join(
        f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        for rank, (error, _) in sorted(e.failures.items())
    )


# Keys of one parameter (``kind/<parameter name>...``).
PER_PARAMETER = ("model", "optimizer", "optimizer_value", "param_group")
# Objects that are not tensors (hyperparameters, random generator states) go in pickled, as uint8 tensors: DCP reads
# tensors into the dict it is given, which its own path for objects does not do. The ones a resume reads back (not
# param groups, nor an older checkpoint's scheduler state):
OBJECTS = ("optimizer_value", "progress", "rng", "data")
PER_RANK = ("rng", "data")  # keyed by rank: read back by the same rank at the same world size (data: rank 0's else)


def _split(key: str) -> tuple[str, str, str]:
    """``kind/name[/state key]`` -> (kind, name, state key); parameter names hold dots, never slashes."""
    kind, _, rest = key.partition("/")
    if kind in ("optimizer", "optimizer_value"):
        name, _, state_key = rest.rpartition("/")
        return kind, name, state_key
    return kind, rest, ""


def optimizer_mismatch(marker: dict, config: dict) -> str | None:
    """Why a checkpoint (its ``marker``) cannot restore the optimizer ``config`` builds: the state of another class
    (AdamW's moments mean nothing to SignSGD); None where it can, or its marker names none. Also asked when a run
    naming the checkpoint is validated (``moe_lab.job.lifecycle``), so that the refusal keeps the run's record."""
    saved, this = _optimizer_class(marker.get("config")), _optimizer_class(config)
    if saved and this and saved != this:
        return (
            f"it holds the state of {saved}, this run's optimizer is {this} (resume it with its own optimizer, "
            f"optimizer._target_={saved}, or start afresh: trainer.resume=never)"
        )
    return None


def writer_kept_masters(marker: dict) -> bool:
    """Whether a checkpoint's ``master`` states are its fp32 weights: written by a run that kept them apart from its
    weights (offload=full; a marker naming no offload option is taken at its word). A run of another offload mode
    resumed from offload=full's checkpoint before 2026-12-07 carried those masters on into its own checkpoints,
    stale."""
    offload = ((marker.get("config") or {}).get("offload") or {}).get("_target_")
    return offload is None or offload == f"{FullOffload.__module__}.{FullOffload.__qualname__}"


def _optimizer_class(config: dict | None) -> str | None:
    """The optimizer class a run's config names (``optimizer._target_``), if it names one."""
    return ((config or {}).get("optimizer") or {}).get("_target_")


def _pickled(obj) -> torch.Tensor:
    return torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)


def _unpickled(tensor: torch.Tensor):
    return pickle.loads(tensor.numpy().tobytes())


class _AlreadyCopied(AsyncStager):
    """DCP's own staging copies each tensor's whole storage (all of offload=full's flat masters for one
    parameter's view) and fails on a DTensor over a view at an offset (torch 2.13); ``_state_dict(copy=True)`` has
    copied just the pieces."""

    _synchronize_after_execute = False

    def stage(self, state_dict, **kwargs):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _save_planner():
    # Flat keys, each a tensor.
    return dcp.DefaultSavePlanner(flatten_state_dict=False)


def _load_planner():
    return dcp.DefaultLoadPlanner(flatten_state_dict=False)


def _from_rank0(value):
    if not dist.is_initialized() or is_emulated():  # an emulated rank is the job's one process: its value is rank 0's
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _rng_state(device: torch.device) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict, device: torch.device) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
