"""offload=full: the optimizer runs on the host, inside backward.

Precision scheme: the device holds only compute-dtype weights (bf16 on GPU); fp32 master weights and the optimizer
state live in host RAM. Each gradient arrives in the compute dtype (FSDP2 reduces in fp32, then casts to the
parameter's dtype), is widened to fp32 on the host and steps the fp32 masters; the new masters are rounded to the
compute dtype and copied back. With fp32 compute (the CPU default) the device copies equal the masters.

Data flow, per chunk of parameters (consecutive in reverse registration order, roughly the order backward
finishes them):
1. a post-accumulate-grad hook copies each final gradient (this rank's shard) device -> host on a side stream into
   the chunk's pinned transfer buffer, then frees the device gradient;
2. when the chunk's last gradient is queued, a CPU worker thread waits for the copies and steps the chunk's masters
   with the gradients in the transfer buffer (``host_step``: one call of a multi-threaded C kernel per master,
   with the GIL released, that widens each gradient to fp32, steps the master and the optimizer state, and writes
   the new weight into the transfer buffer in the compute dtype, in one pass over memory);
3. it copies the new weights host -> device on another side stream, and moves on to the next chunk without waiting
   for that copy: the next gradients copied into the buffer are ordered after it on the GPU.
``step()`` waits for the worker to finish every chunk and orders the compute stream after the weights' copies.

With ``device_share`` > 0 the chunks backward finishes last (the first layers, the embedding), as many as fit in
that share of the parameters, keep their fp32 masters and optimizer state on the device instead and step there, on a
side stream, with the configured optimizer (the gradients widened to fp32, the new masters narrowed into the
weights): the host's work, which the step's end waits for, shrinks by that share, for 12 bytes per parameter of it
on the device (AdamW; experiments/offload_accum).
At most ``max_inflight`` transfer buffers exist; a hook that finds none free, or a ``step()`` that waits longer than
``timeout_s``, raises instead of hanging.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable

import torch
from torch import nn

from moe_lab.optim.offload import host_kernel
from moe_lab.optim.offload.chunked import (
    ChunkedOptimizer,
    attach_post_accumulate_grad_hooks,
    chunked,
    load_keeping_group,
)
from moe_lab.optim.offload.host import SideStream, check_host_memory, host_empty, synchronize
from moe_lab.optim.offload.host_step import host_optimizer, prompt_gil_handover
from moe_lab.parallel.sharding import local_shard

# The state key of a parameter's fp32 master in ``state_dict()``: a checkpoint of this optimizer holds the weights at
# full precision there, whatever the device copies' dtype.
MASTER = "master"


class MasterChunk:
    """Consecutive parameters whose fp32 masters form one flat tensor, stepped as soon as all their gradients are in:
    in host memory by the host step, or (``on_device``) on the training device by the configured optimizer."""

    def __init__(
        self, params: list[nn.Parameter], master: torch.Tensor, make_optimizer: Callable, on_device: bool = False
    ):
        self.params = params
        self.offsets, offset = {}, 0  # parameter -> (offset, numel) of its local shard in the master
        for p in params:
            self.offsets[p] = (offset, local_shard(p).numel())
            offset += local_shard(p).numel()
        self.numel = offset
        self.master = nn.Parameter(master)
        self.on_device = on_device
        self.optimizer = make_optimizer([self.master]) if on_device else host_optimizer(make_optimizer, [self.master])
        self.buffer: torch.Tensor | None = None  # the transfer buffer it holds while in flight
        self.received: set[nn.Parameter] = set()


class InBackwardOptimizer(ChunkedOptimizer):
    """offload=full's optimizer (see the module's docstring). Its ``param_groups`` are the chunks' host optimizers'
    groups, which the CPU worker reads when it steps a chunk during the next backward."""

    def __init__(
        self,
        params: list[nn.Parameter],
        make_optimizer: Callable,
        compute_dtype: torch.dtype,
        chunk_numel: int,
        max_inflight: int,
        timeout_s: float,
        num_threads: int,
        device_share: float = 0.0,
    ):
        """``params`` still hold their fp32 initial values: they become the masters. The caller casts the device
        parameters to ``compute_dtype`` afterwards and then calls ``attach()``."""
        host_kernel.load()  # built now (at first use on a machine): a missing C compiler fails before training
        params = [p for p in params if p.requires_grad]
        self.device = device = local_shard(params[0]).device
        self.timeout_s, self.num_threads = timeout_s, num_threads
        groups = chunked(reversed(params), chunk_numel)
        sizes = [sum(local_shard(p).numel() for p in group) for group in groups]
        host_chunks = len(groups) - device_chunk_count(sizes, device_share)
        total = sum(sizes[:host_chunks])
        largest = max(sizes[:host_chunks], default=0)
        buffers = max(1, min(max_inflight, host_chunks))
        # Masters, AdamW's two moments (the most state a host optimizer here has; its first step creates them) and
        # the transfer buffers, all checked before any is allocated.
        check_host_memory(
            total * 3 * 4 + largest * buffers * compute_dtype.itemsize, "offload=full host state and buffers"
        )
        masters = host_empty(total, torch.float32, False, "offload=full fp32 master weights")
        self.chunks: list[MasterChunk] = []
        start = 0
        for index, (group, n) in enumerate(zip(groups, sizes)):
            if index < host_chunks:
                chunk = MasterChunk(group, masters[start : start + n], make_optimizer)
                start += n
            else:
                chunk = MasterChunk(
                    group, torch.empty(n, dtype=torch.float32, device=device), make_optimizer, on_device=True
                )
            with torch.no_grad():
                for p, (offset, size) in chunk.offsets.items():
                    chunk.master[offset : offset + size].copy_(local_shard(p).reshape(-1))
            self.chunks.append(chunk)
        self.chunk_of = {p: c for c in self.chunks for p in c.params}
        super().__init__(params, [c.optimizer for c in self.chunks])

        pinned = device.type == "cuda"
        self.free: queue.Queue = queue.Queue()
        for _ in range(buffers):  # (buffer, event after which its last weights have left it)
            self.free.put((host_empty(largest, compute_dtype, pinned, "offload=full transfer buffers"), None))
        self.d2h, self.h2d, self.steps = SideStream(device), SideStream(device), SideStream(device)

        self.gradients_final = True  # False in the backward of a micro-batch before a step's last (FullOffload)
        self.host_seconds = self.waited = 0.0  # since the last step_metrics(): the host step's time, step()'s wait
        self.host_params = 0
        self.ready: queue.Queue = queue.Queue()
        self.in_flight = 0
        self.done = threading.Condition()
        self.error: BaseException | None = None
        # The worker holds the optimizer only while it steps a chunk, and ends once the optimizer is collected: a
        # sweep that runs its points in one process frees each point's host state before the next point builds
        # its own.
        self.worker = threading.Thread(
            target=_worker_loop, args=(weakref.ref(self), self.ready), name="offload-full-step", daemon=True
        )
        # Also at interpreter exit (a failed run's traceback keeps the optimizer alive until then): the worker ends
        # before finalization, which would abort it mid-Python (std::terminate) where it frees a chunk.
        self.stop_worker = weakref.finalize(self, _stop_worker, self.ready, self.worker)
        self.worker.start()

    def attach(self) -> None:
        """Start stepping in backward: one post-accumulate-grad hook per parameter."""
        attach_post_accumulate_grad_hooks(self.params, self._on_grad)

    def step_metrics(self) -> dict:
        """The last optimizer step's host work, for the step's metrics row: the host step's own time
        (``host_step_s``, summed over the chunks: the worker steps one at a time) and rate, and how long ``step()``
        waited for it after backward (``host_wait_s``: the host step's exposed part, as the training thread saw it)."""
        with self.done:
            seconds, params, self.host_seconds, self.host_params = self.host_seconds, self.host_params, 0.0, 0
        metrics = {"host_step_s": seconds, "host_wait_s": self.waited}
        if seconds:
            metrics["host_step_gparams_per_s"] = params / seconds / 1e9
        return metrics

    def master_weights(self) -> list[torch.Tensor]:
        """fp32 master of each parameter (views of host memory), in parameter order."""
        out = {}
        for c in self.chunks:
            for p, (offset, size) in c.offsets.items():
                out[p] = c.master.detach()[offset : offset + size].view(local_shard(p).shape)
        return [out[p] for p in self.params]

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.gradients_final:
            return  # an earlier micro-batch of the step: the gradient keeps accumulating on the device
        self._raise_worker_error()
        chunk = self.chunk_of[p]
        if chunk.on_device:
            chunk.received.add(p)
            if len(chunk.received) == len(chunk.params):
                self._step_on_device(chunk)
            return
        if chunk.buffer is None:
            chunk.buffer = self._take_buffer()
        offset, size = chunk.offsets[p]
        self.d2h.copy(chunk.buffer[offset : offset + size], local_shard(p.grad).reshape(-1))
        p.grad = None  # the copy keeps the device gradient alive until it has run
        chunk.received.add(p)
        if len(chunk.received) == len(chunk.params):
            self._submit(chunk)

    def _step_on_device(self, chunk: MasterChunk) -> None:
        """Step a chunk whose master is on the device, on a side stream after the gradients' making: the gradients
        (zero for a parameter without one) widened into one fp32 tensor, the optimizer's step, the new masters
        narrowed into the weights."""
        self.steps.after_current()
        with self.steps.use():
            grad = torch.zeros(chunk.numel, dtype=torch.float32, device=chunk.master.device)
            for p, (offset, size) in chunk.offsets.items():
                if p.grad is not None:
                    grad[offset : offset + size].copy_(local_shard(p.grad).reshape(-1))
                    self.steps.keep_for(local_shard(p.grad))  # freed below, on the compute stream's side
                    p.grad = None
            chunk.master.grad = grad
            chunk.optimizer.step()
            chunk.master.grad = None
            for p, (offset, size) in chunk.offsets.items():
                local_shard(p).detach().view(-1).copy_(chunk.master.detach()[offset : offset + size])
        chunk.received.clear()

    def _take_buffer(self) -> torch.Tensor:
        try:
            buffer, weights_sent = self.free.get(timeout=self.timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"offload=full: no free transfer buffer after {self.timeout_s} s (offload.timeout_s): the CPU "
                f"optimizer worker is stuck or far behind backward (offload.max_inflight buffers are all in use)"
            ) from None
        if weights_sent is not None:
            self.d2h.stream.wait_event(weights_sent)  # gradients go in once the last chunk's weights have left
        return buffer

    def _submit(self, chunk: MasterChunk) -> None:
        with self.done:
            self.in_flight += 1
        self.ready.put((chunk, self.d2h.record()))

    def _run_chunk(self, chunk: MasterChunk, copied: torch.cuda.Event | None) -> None:
        seconds = 0.0
        try:
            synchronize(
                copied
            )  # the gradients are in, and so the buffer's earlier copies are done, before the host touches it
            if self.error is None:
                start = time.perf_counter()
                with torch.profiler.record_function("optimizer.host_step"), prompt_gil_handover():
                    self._step_chunk(chunk)
                seconds = time.perf_counter() - start
        except BaseException as e:
            self.error = e
        finally:
            # Reused once the weights queued from it have left (and after a failure, whatever was queued).
            self.free.put((chunk.buffer, self.h2d.record()))
            chunk.buffer = None
            chunk.received.clear()
            with self.done:
                self.in_flight -= 1
                self.host_seconds += seconds
                self.host_params += chunk.numel
                self.done.notify_all()

    def _step_chunk(self, chunk: MasterChunk) -> None:
        buffer = chunk.buffer[: chunk.numel]
        chunk.optimizer.step(transfer=buffer)
        for p, (offset, size) in chunk.offsets.items():
            self.h2d.copy(local_shard(p).view(-1), buffer[offset : offset + size], after_current=False)

    def _step_chunks(self) -> None:
        """Backward has ended: take the gradients that earlier micro-batches left on parameters the last one did not
        reach, step the chunks that got only some of their gradients (a parameter without one steps with a zero
        gradient), then wait for the worker."""
        for p in self.params:
            if p.grad is not None:
                self._on_grad(p)
        for chunk in self.chunks:
            if chunk.received and len(chunk.received) < len(chunk.params):
                if chunk.on_device:
                    self._step_on_device(chunk)
                    continue
                if self.h2d.stream is not None:  # a host write: the buffer's last weights must have left it
                    self.h2d.stream.synchronize()
                for p in chunk.params:
                    if p not in chunk.received:
                        offset, size = chunk.offsets[p]
                        chunk.buffer[offset : offset + size].zero_()
                self._submit(chunk)
        start = time.perf_counter()
        with self.done:
            finished = self.done.wait_for(lambda: self.in_flight == 0, timeout=self.timeout_s)
        self.waited = time.perf_counter() - start
        self._raise_worker_error()
        if not finished:
            raise TimeoutError(
                f"offload=full: {self.in_flight} chunk(s) not stepped after {self.timeout_s} s (offload.timeout_s)"
            )
        if self.h2d.stream is not None:  # the next forward reads the new weights
            torch.cuda.current_stream(self.h2d.stream.device).wait_stream(self.h2d.stream)
        self.steps.then_current()

    def _chunks(self) -> list[MasterChunk]:
        return self.chunks

    def _settle(self) -> None:
        with self.done:
            self.done.wait_for(lambda: self.in_flight == 0, timeout=self.timeout_s)
        self._raise_worker_error()
        self.h2d.synchronize()
        self.steps.synchronize()

    def _param_states(self, chunk: MasterChunk) -> list[dict]:
        """The master and the chunk's optimizer state, sliced per parameter (the step count is the chunk's)."""
        flat = chunk.optimizer.state.get(chunk.master, {})
        states = []
        for p, (offset, size) in chunk.offsets.items():
            shape = local_shard(p).shape
            entry = {MASTER: chunk.master.detach()[offset : offset + size].view(shape)}
            for key, value in flat.items():
                per_element = torch.is_tensor(value) and value.dim() > 0
                entry[key] = value[offset : offset + size].view(shape) if per_element else value
            states.append(entry)
        return states

    @torch.no_grad()
    def _load_chunk(self, chunk: MasterChunk, hyperparameters: dict, entries: list[dict]) -> None:
        """Masters and state into the chunk's flat host tensors, then the device weights from the masters. Without a
        master (a checkpoint of another offload mode) a parameter's master is its weight."""
        for p, entry in zip(chunk.params, entries):
            offset, size = chunk.offsets[p]
            chunk.master[offset : offset + size].copy_(entry.get(MASTER, local_shard(p)).reshape(-1))
        flat = {}
        for key in {key for entry in entries for key in entry} - {MASTER}:
            values = [entry.get(key) for entry in entries]
            if any(v is None for v in values):
                raise ValueError(f"offload=full: optimizer state {key!r} is missing for some parameters of a chunk")
            if torch.is_tensor(values[0]) and values[0].dim() > 0:
                flat[key] = torch.empty(chunk.numel, dtype=values[0].dtype, device=chunk.master.device)
                for (offset, size), value in zip(chunk.offsets.values(), values):
                    flat[key][offset : offset + size].copy_(value.reshape(-1))
            else:
                flat[key] = values[0]  # one per chunk (AdamW's step count): each of its parameters carries it
        load_keeping_group(chunk.optimizer, {0: flat} if flat else {}, hyperparameters)
        for p, (offset, size) in chunk.offsets.items():
            local_shard(p).detach().copy_(chunk.master[offset : offset + size].view(local_shard(p).shape))

    def _raise_worker_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            error.add_note("raised in the offload=full CPU optimizer worker")
            raise error  # as is, so a host OutOfMemoryError is still recorded as an oom point


def device_chunk_count(sizes: list[int], share: float) -> int:
    """How many of the last chunks (those backward finishes last) step on the device: as many as fit, whole, in
    ``share`` of all the chunks' parameters."""
    budget, count = share * sum(sizes), 0
    for n in reversed(sizes):
        if n > budget:
            break
        budget -= n
        count += 1
    return count


def _stop_worker(ready: queue.Queue, worker: threading.Thread) -> None:
    ready.put(None)
    if worker is not threading.current_thread():  # the worker itself may drop the optimizer's last reference
        worker.join(timeout=60)  # bounded: a hung chunk must not hang the exit


@torch.no_grad()
def _worker_loop(owner: weakref.ref, ready: queue.Queue) -> None:
    """The CPU worker's loop: step each submitted chunk; ``None`` (put when the optimizer is collected) ends it."""
    optimizer = owner()
    if optimizer is None:
        return
    # OpenMP's thread count is per calling thread: the host step kernel's, and torch's for the state its first step
    # creates.
    torch.set_num_threads(optimizer.num_threads)
    if optimizer.device.type == "cuda":
        torch.cuda.set_device(optimizer.device)  # else its stream switches would open a context on GPU 0
    del optimizer
    while (item := ready.get()) is not None:
        optimizer = owner()
        if optimizer is None:
            return
        optimizer._run_chunk(*item)
        del optimizer, item  # hold no chunk while waiting
