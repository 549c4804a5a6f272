"""Activations to host memory: ``ac.offload_activations``. Every tensor autograd saves inside a decoder block goes
to pinned host memory on a side stream during forward and comes back ahead of backward: a block's first unpack in
backward fetches its tensors and prefetches the block before it, so each copy in overlaps the block after it.

Left on the device: tensors under ``MIN_BYTES`` (copies too small to pay), parameters (FSDP2's unsharded weights are
resharded and gathered again by FSDP2 itself) and tensors of a parameter's shape (the weights' bf16 casts, which
autocast and the experts make every step: moving them would cost a model's worth of PCIe per step), and the last
block's tensors (its backward comes first: nothing to overlap the copy back with). A tensor saved twice in one block
is copied once.
On CPU (no CUDA) the same path runs with plain copies and no streams, so tests see what moved (``moved``).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

MIN_BYTES = 2**20


class _Block:
    """One block's saved tensors of the forward in flight: on the host after forward, back on the device once
    fetched."""

    def __init__(self):
        self.saved: list[_Saved] = []
        self.fetched = False
        self.backward_started = False
        self.ready = None  # the side stream's event after the copies in (CUDA)
        self.seen: dict[int, tuple[weakref.ref, _Saved]] = {}  # id(tensor) -> the handle of a tensor saved before


class _Saved:
    __slots__ = ("block", "device_tensor", "host", "device")

    def __init__(self, block: _Block, device_tensor=None, host=None, device=None):
        self.block, self.device_tensor, self.host, self.device = block, device_tensor, host, device


class ActivationOffload:
    """Hooks around each layer's call (``nn.Module`` forward pre/post hooks: outside the compiled ``forward``), so
    compiled blocks' saved tensors, selective AC's kept outputs among them, pass through them."""

    def __init__(self, layers: list[nn.Module]):
        self.moved = {"tensors": 0, "bytes": 0}  # what went to the host since the start (tests, logs)
        self.blocks: list[_Block | None] = [None] * len(layers)
        self.stream = None
        self._context = None
        self.weight_shapes = [{tuple(p.shape) for p in layer.parameters()} for layer in layers]
        for index, layer in enumerate(layers):
            layer.register_forward_pre_hook(lambda module, args, index=index: self._enter(index))
            layer.register_forward_hook(lambda module, args, out: self._exit())

    def _enter(self, index: int) -> None:
        if not torch.is_grad_enabled():
            return
        block = self.blocks[index] = _Block()
        offload = index < len(self.blocks) - 1
        weights = self.weight_shapes[index]
        self._context = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(t, block, offload and tuple(t.shape) not in weights),
            lambda saved: self._unpack(saved, index),
        )
        self._context.__enter__()

    def _exit(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def _pack(self, t: torch.Tensor, block: _Block, offload: bool) -> _Saved:
        if not offload or isinstance(t, nn.Parameter) or t.numel() * t.element_size() < MIN_BYTES:
            return _Saved(block, device_tensor=t)
        earlier = block.seen.get(id(t))
        if earlier is not None and earlier[0]() is t:
            return earlier[1]
        if t.is_cuda:
            if self.stream is None:
                self.stream = torch.cuda.Stream(t.device)
            host = torch.empty_like(t, device="cpu", pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))  # t is written
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # its memory is reused only once the copy has read it
        else:
            host = t.clone()
        saved = _Saved(block, host=host, device=t.device)
        block.saved.append(saved)
        block.seen[id(t)] = (weakref.ref(t), saved)
        self.moved["tensors"] += 1
        self.moved["bytes"] += t.numel() * t.element_size()
        return saved

    def _fetch(self, index: int) -> None:
        block = self.blocks[index] if index >= 0 else None
        if block is None or block.fetched:
            return
        block.fetched, block.seen = True, {}
        on_cuda = [s for s in block.saved if s.device.type == "cuda"]
        for s in block.saved:
            if s.device.type != "cuda":
                s.device_tensor, s.host = s.host.clone(), None
        if on_cuda:
            current = torch.cuda.current_stream(on_cuda[0].device)
            # Allocated on the compute stream (where they are used and freed), filled on the side stream once the
            # compute stream has reached this point.
            for s in on_cuda:
                s.device_tensor = torch.empty_like(s.host, device=s.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                for s in on_cuda:
                    s.device_tensor.copy_(s.host, non_blocking=True)
                    s.host = None
                block.ready = torch.cuda.Event()
                block.ready.record(self.stream)
        block.saved = []

    def _unpack(self, saved: _Saved, index: int) -> torch.Tensor:
        if saved.block is self.blocks[index] and not saved.block.backward_started:
            saved.block.backward_started = True
            self._fetch(index)  # already back where the block after it prefetched it
            self._fetch(index - 1)  # the next block backward runs: its copy overlaps this block's backward
        if saved.block.ready is not None:
            torch.cuda.current_stream(saved.device_tensor.device).wait_event(saved.block.ready)
        return saved.device_tensor
