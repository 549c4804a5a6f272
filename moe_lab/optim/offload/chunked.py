"""The split of parameters into chunks that move and step together, and the torch optimizer made of one optimizer
per chunk that both offload modes are."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn

from moe_lab.parallel.sharding import local_shard


def chunked(params: Iterable[torch.Tensor], max_numel: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of parameters of at most ``max_numel`` local elements (a larger one gets a run of its own)."""
    chunks: list[list[torch.Tensor]] = [[]]
    size = 0
    for p in params:
        n = local_shard(p).numel()
        if chunks[-1] and size + n > max_numel:
            chunks.append([])
            size = 0
        chunks[-1].append(p)
        size += n
    return [c for c in chunks if c]


class ChunkedOptimizer(torch.optim.Optimizer):
    """A torch optimizer that steps the model's parameters through one inner optimizer per chunk, each over tensors
    of its own (host masters, or plain views of the local shards).

    ``param_groups`` are the chunk optimizers' own group dicts, the same objects, so an LR that a
    ``torch.optim.lr_scheduler`` writes into one is the LR its chunk steps with. The gradients are the model
    parameters' (``params``): ``zero_grad`` clears those. The optimizer state lives in the chunk optimizers (and
    moves between host and device), so ``state_dict`` / ``load_state_dict`` are not provided.
    """

    def __init__(self, params: list[nn.Parameter], chunk_optimizers: list[torch.optim.Optimizer]):
        self.params = params
        self.chunk_optimizers = chunk_optimizers
        groups = [group for optimizer in chunk_optimizers for group in optimizer.param_groups]
        # add_param_group keeps each dict: it puts the same tensors in a new list and fills in defaults they have
        super().__init__(groups, chunk_optimizers[0].defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        """Step every chunk with its group's current LR; ``closure`` (forward and backward, returning the loss) runs
        first where given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_chunks()
        return loss

    def _step_chunks(self) -> None:
        """Backward has ended: step the chunks (each subclass moves state or weights its own way)."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is not None:
                p.grad = None if set_to_none else p.grad.detach().zero_()  # zeroed in place, out of any graph

    def state_dict(self):
        raise NotImplementedError(f"{type(self).__name__} keeps its state in its chunk optimizers; saving it is not implemented")

    def load_state_dict(self, state_dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} keeps its state in its chunk optimizers; loading it is not implemented")
