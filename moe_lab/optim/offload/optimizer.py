"""offload=optimizer: the optimizer's per-element state (AdamW's moments) lives in pinned host memory and visits
the device one chunk at a time during ``step()``."""

from __future__ import annotations

from collections import deque
from typing import Callable

import torch
from torch import nn

from moe_lab.optim.offload.chunked import ChunkedOptimizer, chunked, load_keeping_group
from moe_lab.optim.offload.host import SideStream, host_empty, synchronize
from moe_lab.parallel.sharding import local_shard


class StateChunk:
    """Consecutive parameters and an optimizer of their own whose per-element state is kept in host memory
    between steps."""

    def __init__(self, params: list[nn.Parameter], make_optimizer: Callable):
        self.params = params
        # Plain tensors sharing storage with the local shards: the optimizer steps those, never a DTensor.
        self.shards = [nn.Parameter(local_shard(p).detach()) for p in params]
        self.optimizer = make_optimizer(self.shards)
        self.host: dict[tuple[int, str], torch.Tensor] = {}  # (shard index, state key) -> host copy


class StreamedStateOptimizer(ChunkedOptimizer):
    """Weights and gradients stay on the device, in the ``none`` precision scheme (fp32 parameters, bf16 compute
    through autocast / FSDP2's mixed-precision policy); the optimizer is the configured one, unchanged.

    ``step()`` walks the chunks in order: chunk i+1's state is copied host -> device on one side stream while chunk
    i steps on the compute stream, and chunk i-1's new state goes device -> host on another. At most
    ``max_inflight`` chunks' state is on the device at once, so the state costs a few chunks of device memory and
    never adds to the activations' peak. State is created on the device by the optimizer's first step and moved to
    host memory right after it. A state tensor with no elements per parameter (AdamW's step count) stays put.
    Its ``param_groups`` are the chunk optimizers' groups.
    """

    def __init__(self, params: list[nn.Parameter], make_optimizer: Callable, device: torch.device, chunk_numel: int, max_inflight: int):
        params = [p for p in params if p.requires_grad]
        self.chunks = [StateChunk(c, make_optimizer) for c in chunked(params, chunk_numel)]
        super().__init__(params, [c.optimizer for c in self.chunks])
        self.pinned = device.type == "cuda"
        self.max_inflight = max(1, max_inflight)
        self.h2d, self.d2h = SideStream(device), SideStream(device)

    def _step_chunks(self) -> None:
        for chunk in self.chunks:
            for p, shard in zip(chunk.params, chunk.shards):
                shard.data = local_shard(p)  # FSDP2 may have re-created the local shard since the last step
                shard.grad = None if p.grad is None else local_shard(p.grad)
        if self.h2d.stream is not None:
            self.h2d.stream.wait_stream(self.d2h.stream)  # last step's state is home before it is read again
        offloads: deque = deque()
        loaded = self._load(self.chunks[0])
        for i, chunk in enumerate(self.chunks):
            state, loaded = loaded, self._load(self.chunks[i + 1]) if i + 1 < len(self.chunks) else None
            self._install(chunk, state)
            chunk.optimizer.step()
            offloads.append(self._offload(chunk))
            if len(offloads) >= self.max_inflight:
                synchronize(offloads.popleft())  # bounds the chunks whose state is on the device
        for chunk in self.chunks:
            for shard in chunk.shards:
                shard.grad = None

    def _load(self, chunk: StateChunk) -> dict:
        """Start copying a chunk's state to the device: its tensors by (shard, key), and the copy's event."""
        tensors = {(i, key): self.h2d.fetch(host, chunk.shards[i].device) for (i, key), host in chunk.host.items()}
        return {"tensors": tensors, "event": self.h2d.record()}

    def _install(self, chunk: StateChunk, loaded: dict) -> None:
        if loaded["event"] is not None:
            current = torch.cuda.current_stream()
            current.wait_event(loaded["event"])
            for tensor in loaded["tensors"].values():
                tensor.record_stream(current)  # allocated on the side stream, used on this one
        for (i, key), tensor in loaded["tensors"].items():
            chunk.optimizer.state[chunk.shards[i]][key] = tensor

    def _offload(self, chunk: StateChunk) -> torch.cuda.Event | None:
        """Copy the chunk's per-element state home and leave only the host copies referenced."""
        for i, shard in enumerate(chunk.shards):
            state = chunk.optimizer.state.get(shard, {})
            for key, value in state.items():
                if not torch.is_tensor(value) or value.dim() == 0:
                    continue
                host = chunk.host.get((i, key))
                if host is None:
                    host = host_empty(value.numel(), value.dtype, self.pinned, "offload=optimizer state").view_as(value)
                    chunk.host[(i, key)] = host
                if host is not value:
                    self.d2h.copy(host, value)
                    state[key] = host
        return self.d2h.record()

    def _chunks(self) -> list[StateChunk]:
        return self.chunks

    def _settle(self) -> None:
        if self.d2h.stream is not None:  # the last chunks' state may still be on its way home
            self.d2h.stream.synchronize()

    def _param_states(self, chunk: StateChunk) -> list[dict]:
        return [dict(chunk.optimizer.state.get(shard, {})) for shard in chunk.shards]

    def _load_chunk(self, chunk: StateChunk, hyperparameters: dict, entries: list[dict]) -> None:
        for p, shard in zip(chunk.params, chunk.shards):
            shard.data = local_shard(p)
        # torch puts the state on the device; it goes home at once, as after a step, one chunk at a time.
        load_keeping_group(chunk.optimizer, {i: e for i, e in enumerate(entries) if e}, hyperparameters)
        synchronize(self._offload(chunk))
