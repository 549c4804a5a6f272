"""The split of parameters into chunks that move and step together, and the torch optimizer made of one optimizer
per chunk that both offload modes are."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable

import torch
from torch import nn

from moe_lab.parallel.sharding import local_shard, shaped_like


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


def attach_post_accumulate_grad_hooks(params: list[nn.Parameter], on_grad: Callable[[nn.Parameter], None]) -> None:
    """Call ``on_grad(p)`` (a bound method of an optimizer) each time a gradient has been accumulated into ``p.grad``
    (under FSDP2: into the sharded gradient, after its reduce-scatter). Through a weak reference: autograd keeps
    hooks where Python's garbage collector cannot see them, so a bound method would keep its optimizer (and its
    host state) alive as long as the parameters; an optimizer that is gone does nothing."""
    owner = weakref.WeakMethod(on_grad)

    def hook(p: nn.Parameter) -> None:
        if (method := owner()) is not None:
            method(p)

    for p in params:
        p.register_post_accumulate_grad_hook(hook)


class ChunkedOptimizer(torch.optim.Optimizer):
    """A torch optimizer that steps the model's parameters through one inner optimizer per chunk, each over tensors
    of its own (host masters, or plain views of the local shards).

    ``param_groups`` are the chunk optimizers' own group dicts, the same objects, so an LR that a
    ``torch.optim.lr_scheduler`` writes into one is the LR its chunk steps with. The gradients are the model
    parameters' (``params``): ``zero_grad`` clears those.

    ``state_dict()`` is torch's format in terms of the model's parameters, whatever the chunks hold (whole
    parameters, or pieces of one): ``state`` maps the position of a parameter in ``params`` (the model's parameters
    in order, as for a torch optimizer built over ``model.parameters()``) to that parameter's state, each per-element tensor shaped like the parameter (a DTensor
    where the parameter is one, see ``moe_lab.parallel.sharding.shaped_like``) and left where the optimizer keeps it
    (host memory) unless its pieces had to be joined; ``param_groups`` are the chunks' groups, ``params`` naming
    positions in ``params`` (a split parameter in the group of each chunk holding a piece of it).
    ``load_state_dict`` takes that format, with the groups of this optimizer's own ``state_dict()`` (hyperparameters
    may differ) and state tensors on any device, so a checkpoint written at another chunking or mesh loads.
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

    def state_dict(self) -> dict:
        self._settle()
        position = {p: i for i, p in enumerate(self.params)}
        pieces: dict[int, list[dict]] = {}  # position -> the state of its pieces, in chunk order (one, unless split)
        groups = []
        for chunk, optimizer in zip(self._chunks(), self.chunk_optimizers):
            (group,) = optimizer.param_groups
            groups.append(
                {**{k: v for k, v in group.items() if k != "params"}, "params": [position[p] for p in chunk.params]}
            )
            for p, entry in zip(chunk.params, self._param_states(chunk)):
                pieces.setdefault(position[p], []).append(entry)
        state = {}
        for i, entries in sorted(pieces.items()):
            p = self.params[i]
            state[i] = {
                key: shaped_like(p, value) if torch.is_tensor(value) and value.dim() > 0 else value
                for key, value in _joined(entries, local_shard(p).shape).items()
            }
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict["param_groups"]
        position = {p: i for i, p in enumerate(self.params)}
        expected = [[position[p] for p in chunk.params] for chunk in self._chunks()]
        if [list(g["params"]) for g in groups] != expected:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: param_groups must be those of this optimizer's state_dict()"
            )
        self._settle()
        for chunk, group in zip(self._chunks(), groups):
            # Copies: the state may be another optimizer's still in use (torch's own load would share a step count).
            entries = [
                {
                    key: local_shard(v).clone() if torch.is_tensor(v) else v
                    for key, v in state_dict["state"].get(position[p], {}).items()
                }
                for p in chunk.params
            ]
            self._load_chunk(chunk, {k: v for k, v in group.items() if k != "params"}, entries)

    def _chunks(self) -> list:
        """The chunks, each with ``params`` (model parameters) and in the order of ``chunk_optimizers``."""
        raise NotImplementedError

    def _settle(self) -> None:
        """Wait for state still in flight (copies on a side stream, a worker's step) before it is read or replaced."""

    def _param_states(self, chunk) -> list[dict]:
        """The state of each of ``chunk.params``: per-element tensors shaped like its local shard, or, where the
        chunk holds a piece of it (a run of its flattened elements; the pieces in chunk order cover it), flat and
        the size of that piece; other values as is (the same in every piece)."""
        raise NotImplementedError

    def _load_chunk(self, chunk, hyperparameters: dict, entries: list[dict]) -> None:
        """Install the state of each of ``chunk.params`` (per-element tensors shaped like its whole local shard, on
        any device; the chunk takes its piece)."""
        raise NotImplementedError


def _joined(entries: list[dict], shape: torch.Size) -> dict:
    """One parameter's state from that of its pieces: per-element tensors concatenated and shaped like its local
    shard, other values from the first piece."""
    if len(entries) == 1:
        return entries[0]
    return {
        key: torch.cat([e[key].reshape(-1) for e in entries]).view(shape)
        if torch.is_tensor(value) and value.dim() > 0
        else value
        for key, value in entries[0].items()
    }


def load_keeping_group(optimizer: torch.optim.Optimizer, state: dict[int, dict], hyperparameters: dict) -> None:
    """torch's ``load_state_dict`` on a one-group chunk optimizer (it puts each value where the optimizer wants it:
    AdamW's step count on the parameter's device for the fused kernel, and so on), keeping the group the same dict:
    that dict is also the chunked optimizer's, where LR schedulers write."""
    (group,) = optimizer.param_groups
    group.update(hyperparameters)
    optimizer.load_state_dict(
        {"state": state, "param_groups": [{**group, "params": list(range(len(group["params"])))}]}
    )
    optimizer.param_groups[0] = group
