"""offload=optimizer: the optimizer's per-element state (AdamW's moments) lives in pinned host memory and visits
the device one chunk at a time, during the backward of each optimizer step's last micro-batch.

Per chunk of parameters (consecutive in reverse registration order, roughly the order backward finishes them; an
element-wise optimizer's larger parameters cut into pieces of a chunk, so that chunks stay small), in that order,
through a ring of device memory the size of ``max_inflight`` of the largest chunks' state:
1. its state is copied host -> device into the ring on one side stream, ahead of its gradients: as many chunks as
   the ring holds as the step's first micro-batch starts, each later one as soon as the chunks whose place in the
   ring it takes have stepped (the copy waits, on the GPU, for their state to have left);
2. when all its gradients are final (a post-accumulate-grad hook; under FSDP2 after its reduce-scatter), it steps
   on a stream of its own, after its state has arrived and its gradients were made, while backward goes on;
3. its new state goes device -> host on another side stream, which may run on into the next step's forward: the
   state is needed again one whole step later.
The CPU never waits for a copy: every order above is a CUDA event. ``step()`` steps the chunks that backward left
(a parameter whose gradient came from an earlier micro-batch only), and orders the compute stream after the steps,
which the next forward's reads of the weights need.

A chunk's first step (its state does not exist before it) and the step of a chunk whose state grew (a parameter
that had no gradient before) run outside the ring, with the state created on the device and sent home at once: the
first after backward, in ``step()``. Gradient clipping is impossible (a global norm exists only once backward ends,
after the chunks stepped): ``OptimizerOffload.validate`` refuses it.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from moe_lab.optim.offload.chunked import ChunkedOptimizer, attach_post_accumulate_grad_hooks, load_keeping_group
from moe_lab.optim.offload.host import SideStream, host_empty, synchronize
from moe_lab.optim.optimizers import SignSGD
from moe_lab.parallel.sharding import local_shard

# Optimizers whose update of an element depends on that element's parameter, gradient and state alone: stepping a
# parameter in pieces, each with its own state, is stepping it whole. A larger parameter is split into pieces of at
# most a chunk, so that chunks, and the device ring their state passes through, stay small.
ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, SignSGD)

# Byte alignment of each state tensor in a chunk's flat layout: CUDA's vectorised optimizer kernels want at least 16.
ALIGN = 256


@dataclass(frozen=True)
class StateSlot:
    """Where one per-element state tensor lives in a chunk's flat byte layout."""

    shard: int  # index of the parameter in its chunk
    key: str
    dtype: torch.dtype
    shape: torch.Size
    offset: int  # bytes

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        numel = self.shape.numel()
        return flat[self.offset : self.offset + numel * self.dtype.itemsize].view(self.dtype).view(self.shape)


class Piece(NamedTuple):
    """Elements ``[start, end)`` of a parameter's local shard, flattened; ``whole``: all of it, kept in its shape."""

    param: nn.Parameter
    start: int
    end: int
    whole: bool

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of ``t``, a tensor shaped like the parameter's local shard (a view: never a copy)."""
        return t if self.whole else t.view(-1)[self.start : self.end]


def is_elementwise(make_optimizer: Callable) -> bool:
    cls = make_optimizer.func if isinstance(make_optimizer, functools.partial) else make_optimizer
    return isinstance(cls, type) and issubclass(cls, ELEMENTWISE)


def chunked_pieces(params: list[nn.Parameter], max_numel: int, split: bool) -> list[list[Piece]]:
    """Consecutive runs of at most ``max_numel`` local elements; with ``split`` a larger parameter is cut into pieces
    of at most ``max_numel`` (a multiple of 64 elements where it is larger, for vectorised kernels), each the start
    of a run, else it gets a run of its own."""
    size = max_numel // 64 * 64 if split and max_numel >= 64 else max_numel
    chunks: list[list[Piece]] = [[]]
    filled = 0
    for p in params:
        n = local_shard(p).numel()
        cuts = range(0, n, size) if split and n > size else [0]
        for start in cuts:
            end = min(n, start + size) if len(cuts) > 1 else n
            if chunks[-1] and filled + end - start > max_numel:
                chunks.append([])
                filled = 0
            chunks[-1].append(Piece(p, start, end, whole=len(cuts) == 1))
            filled += end - start
    return [c for c in chunks if c]


class StateChunk:
    """Consecutive parameters (or pieces of one) and an optimizer of their own whose per-element state is kept in
    one flat host buffer between steps."""

    def __init__(self, pieces: list[Piece], make_optimizer: Callable):
        self.pieces = pieces
        self.params = [piece.param for piece in pieces]
        # Plain tensors sharing storage with the local shards: the optimizer steps those, never a DTensor.
        self.shards = [nn.Parameter(piece.of(local_shard(piece.param).detach())) for piece in pieces]
        self.optimizer = make_optimizer(self.shards)
        self.layout: list[StateSlot] | None = None  # None until the state has been home once
        self.host: torch.Tensor | None = None  # flat bytes, laid out as ``layout``
        self.nbytes = 0
        self.sent_home: torch.cuda.Event | None = None  # after the last copy of the state into ``host``
        self.received: set[nn.Parameter] = set()  # parameters whose final gradient is in, this step

    def per_element_state(self) -> list[tuple[int, str, torch.Tensor]]:
        return [
            (i, key, value)
            for i, shard in enumerate(self.shards)
            for key, value in self.optimizer.state.get(shard, {}).items()
            if torch.is_tensor(value) and value.dim() > 0
        ]

    def lay_out(self, pinned: bool) -> None:
        """Lay the current per-element state out in a new flat host buffer (the first time, or after it grew)."""
        self.layout, offset = [], 0
        for i, key, value in self.per_element_state():
            self.layout.append(StateSlot(i, key, value.dtype, value.shape, offset))
            offset += -(-value.numel() * value.dtype.itemsize // ALIGN) * ALIGN
        self.nbytes = offset
        self.host = host_empty(offset, torch.uint8, pinned, "offload=optimizer state")

    def matches_layout(self) -> bool:
        current = [(i, key, value.dtype, value.shape) for i, key, value in self.per_element_state()]
        return self.layout is not None and current == [(s.shard, s.key, s.dtype, s.shape) for s in self.layout]

    def point_state_at(self, flat: torch.Tensor) -> None:
        """Make the optimizer's per-element state the views of ``flat`` (its place in the ring, or ``host``)."""
        for s in self.layout:
            self.optimizer.state[self.shards[s.shard]][s.key] = s.view(flat)


@dataclass
class Region:
    """Bytes ``[start, end)`` of the ring holding a chunk's state this step; ``left``: the event after which its
    new state has left them (None until the chunk has stepped)."""

    start: int
    end: int
    left: torch.cuda.Event | None = None
    stepped: bool = False
    waits: list = field(default_factory=list)  # ``left`` of the regions it replaced


class StreamedStateOptimizer(ChunkedOptimizer):
    """Weights and gradients stay on the device, in the ``none`` precision scheme (fp32 parameters, bf16 compute
    through autocast / FSDP2's mixed-precision policy); the optimizer is the configured one, unchanged, stepped
    chunk by chunk in backward (see the module's docstring). The state on the device at once fits a ring of
    ``max_inflight`` times the largest chunk's state. A state tensor with no elements per parameter (AdamW's step
    count) stays where the optimizer put it. Its ``param_groups`` are the chunk optimizers' groups.

    ``gradients_final`` (set by ``OptimizerOffload.before_micro_batch``): False in the backward of a micro-batch
    before a step's last, whose gradients only accumulate.
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        make_optimizer: Callable,
        device: torch.device,
        chunk_numel: int,
        max_inflight: int,
    ):
        params = [p for p in params if p.requires_grad]
        pieces = chunked_pieces(list(reversed(params)), chunk_numel, split=is_elementwise(make_optimizer))
        self.chunks = [StateChunk(c, make_optimizer) for c in pieces]
        super().__init__(params, [c.optimizer for c in self.chunks])
        self.chunks_of: dict[nn.Parameter, list[StateChunk]] = {}
        for c in self.chunks:
            for p in c.params:
                self.chunks_of.setdefault(p, []).append(c)
        self.device = device
        self.pinned = device.type == "cuda"
        self.max_inflight = max(1, max_inflight)
        self.ring = torch.empty(0, dtype=torch.uint8, device=device)
        self.regions: deque[Region] = deque()  # placed in the ring, oldest first, this step's and the last one's
        self.cursor = 0  # where the next region starts, unless it has to wrap around
        self.h2d, self.d2h, self.steps = SideStream(device), SideStream(device), SideStream(device)
        self.gradients_final = True
        self.started = False  # this step's pipeline (below) has begun
        self.order: list[StateChunk] = []  # the chunks that step in backward this step, in stepping order
        self.loaded: dict[
            int, tuple[Region, torch.cuda.Event | None]
        ] = {}  # position in ``order`` -> its state's place and arrival
        self.next_load = self.next_step = 0  # positions in ``order``
        attach_post_accumulate_grad_hooks(self.params, self._on_grad)

    def begin_step(self) -> None:
        """Start this step's pipeline: the first chunks' state on its way to the device. Called as the step's
        first micro-batch begins (``OptimizerOffload.before_micro_batch``), else by the first gradient hook."""
        if self.started:
            return
        self.started = True
        self.order = [c for c in self.chunks if c.layout is not None]
        # never more than all of it: an optimizer that is not element-wise keeps whole, maybe large, parameters
        needed = min(
            self.max_inflight * max((c.nbytes for c in self.order), default=0), sum(c.nbytes for c in self.order)
        )
        if self.ring.numel() < needed:
            self.ring = torch.empty(needed, dtype=torch.uint8, device=self.device)
            # The allocator orders a reused block after its last users on the allocating (current) stream only: the
            # first copies into the new ring wait for that stream's work queued so far.
            self.h2d.after_current()
            for stream in (self.h2d, self.steps, self.d2h):
                stream.keep_for(self.ring)  # not reused once replaced until each stream is done with it
            self.regions.clear()
            self.cursor = 0
        self.loaded.clear()
        self.next_load = self.next_step = 0
        self._load_ahead()

    @torch.no_grad()
    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.gradients_final:
            return  # an earlier micro-batch of the step: the gradient keeps accumulating
        self.begin_step()
        for chunk in self.chunks_of[p]:
            chunk.received.add(p)
        while self.next_step < len(self.order) and len(self.order[self.next_step].received) == len(
            self.order[self.next_step].params
        ):
            self._step_next()  # in order: a chunk complete before its predecessors waits for them

    def _place(self, nbytes: int) -> Region | None:
        """A region of the ring for ``nbytes`` after the last one (or from the start, where it does not fit before
        the end) once every chunk whose state is there has stepped, else None; its ``waits`` are the ``left``
        events of the regions it replaces, which the copy into it must wait for."""
        if nbytes == 0:  # no state (SignSGD): nothing to wait for, and nothing later replaces it
            return Region(self.cursor, self.cursor)
        start = self.cursor if self.cursor + nbytes <= self.ring.numel() else 0
        region = Region(start, start + nbytes)
        covered = [r for r in self.regions if r.start < region.end and region.start < r.end]
        if any(not r.stepped for r in covered):
            return None
        for r in covered:
            self.regions.remove(r)
        region.waits = [r.left for r in covered]
        self.regions.append(region)
        self.cursor = region.end
        return region

    def _load_ahead(self) -> None:
        """Copy state host -> device for each next position, in order, while the ring has room for it."""
        while self.next_load < len(self.order):
            chunk = self.order[self.next_load]
            region = self._place(chunk.nbytes)
            if region is None:
                return
            for event in (*region.waits, chunk.sent_home):
                self.h2d.wait(event)  # that part of the ring is free, and the host copy is the last step's state
            if chunk.nbytes:
                self.h2d.copy(self.ring[region.start : region.end], chunk.host, after_current=False)
            self.loaded[self.next_load] = (region, self.h2d.record())
            self.next_load += 1

    def _step_next(self) -> None:
        """Step the chunk at ``next_step`` in its place in the ring, send its new state home, load the next ones."""
        if self.next_step == self.next_load:
            self._load_ahead()  # every chunk placed before it has stepped: it has room
        position, chunk = self.next_step, self.order[self.next_step]
        region, arrived = self.loaded.pop(position)
        flat = self.ring[region.start : region.end]
        self.steps.after_current()  # the gradients are made
        self.steps.wait(arrived)
        with self.steps.use():
            chunk.point_state_at(flat)
            self._step_chunk(chunk)
        self.next_step += 1
        self.d2h.wait_stream_of(self.steps)
        if chunk.matches_layout():
            if chunk.nbytes:
                self.d2h.copy(chunk.host, flat, after_current=False)
            chunk.sent_home = self.d2h.record()
            chunk.point_state_at(chunk.host)
        else:  # the step created state for a parameter that had none: lay it out anew, next step streams it
            self._send_home(chunk)
        region.left, region.stepped = chunk.sent_home, True
        self._load_ahead()

    def _step_chunk(self, chunk: StateChunk) -> None:
        for piece, shard in zip(chunk.pieces, chunk.shards):
            shard.data = piece.of(
                local_shard(piece.param)
            )  # FSDP2 may have re-created the local shard since the last step
            shard.grad = None if piece.param.grad is None else piece.of(local_shard(piece.param.grad))
            if shard.grad is not None:
                self.steps.keep_for(shard.grad)  # freed by zero_grad on another stream, maybe before this step ran
        chunk.optimizer.step()
        for shard in chunk.shards:
            shard.grad = None

    def _send_home(self, chunk: StateChunk) -> None:
        """State the optimizer just created on the device (on the current stream): into a new host layout, at once."""
        chunk.lay_out(self.pinned)
        flat = [value for _, _, value in chunk.per_element_state()]
        for s, value in zip(chunk.layout, flat):
            self.d2h.copy(s.view(chunk.host), value)
        chunk.sent_home = self.d2h.record()
        synchronize(chunk.sent_home)  # bounds the device memory of state created outside the ring
        chunk.point_state_at(chunk.host)

    def _step_chunks(self) -> None:
        """Backward has ended: step, in order, the chunks whose gradients it did not complete, then the chunks
        without host state yet (after backward, their new state sent home one at a time); the next forward reads
        the new weights after all of it."""
        self.begin_step()  # a step whose backward fired no hook
        while self.next_step < len(self.order):
            self._step_next()
        for chunk in self.chunks:
            if chunk.layout is None and any(p.grad is not None for p in chunk.params):
                self.steps.after_current()
                with self.steps.use():
                    self._step_chunk(chunk)
                    self._send_home(chunk)
            chunk.received.clear()
        self.steps.then_current()
        self.started = False

    def _chunks(self) -> list[StateChunk]:
        return self.chunks

    def _settle(self) -> None:
        for stream in (self.steps, self.h2d, self.d2h):
            stream.synchronize()

    def _param_states(self, chunk: StateChunk) -> list[dict]:
        return [dict(chunk.optimizer.state.get(shard, {})) for shard in chunk.shards]

    def _load_chunk(self, chunk: StateChunk, hyperparameters: dict, entries: list[dict]) -> None:
        for piece, shard in zip(chunk.pieces, chunk.shards):
            shard.data = piece.of(local_shard(piece.param))
        entries = [
            {key: piece.of(v) if torch.is_tensor(v) and v.dim() > 0 else v for key, v in entry.items()}
            for piece, entry in zip(chunk.pieces, entries)
        ]
        # torch puts the state on the device; it goes home at once, as after a first step.
        load_keeping_group(chunk.optimizer, {i: e for i, e in enumerate(entries) if e}, hyperparameters)
        if chunk.per_element_state():
            self._send_home(chunk)
        else:
            chunk.layout, chunk.host, chunk.nbytes = None, None, 0
