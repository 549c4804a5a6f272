"""offload=optimizer's stream orderings, checked on the CPU: its ``SideStream``s are replaced by simulated streams
that keep vector clocks (what each stream's queued work is ordered after, through ``wait``, ``after_current``,
``then_current``, events and CPU synchronizations), and every read or write of the device ring, the host state
buffers, the weights and the gradients is logged on the stream it is queued on. Two accesses of the same bytes on
different streams, one of them a write, must be ordered: the later one's stream has waited, directly or through
others, for the earlier one. On a CPU run the real streams are no-ops, so nothing else checks these orderings
without a GPU.

The compute stream is modelled as the CPU run's only stream: each micro-batch's forward reads every weight, each
gradient is written on it just before its post-accumulate-grad hook, and a new ring's memory counts as written on
it last (the caching allocator hands a freed block to the next allocation on the same stream at once).
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from moe_lab.optim.offload import OptimizerOffload
from moe_lab.optim.offload import optimizer as streamed
from moe_lab.optim.optimizers import SignSGD
from moe_lab.parallel.sharding import local_shard


class Simulation:
    def __init__(self):
        self.compute = SimulatedStream.named(self, "compute")
        self.current = [self.compute]
        self.cpu_waited: dict[str, int] = {}  # what the CPU has synchronized with: every later op comes after it
        self.accesses: dict[int, list[tuple]] = {}  # storage -> (stream, clock, lo, hi, write, what)
        self.unordered: list[str] = []

    def access(self, t: torch.Tensor, write: bool, what: str) -> None:
        if t.numel() == 0:
            return
        stream = self.current[-1]
        clock = stream.tick()
        storage = t.untyped_storage().data_ptr()
        lo = t.data_ptr() - storage
        hi = lo + t.numel() * t.element_size()
        earlier = self.accesses.setdefault(storage, [])
        for other, other_clock, other_lo, other_hi, other_write, other_what in earlier:
            overlaps = other_lo < hi and lo < other_hi
            if (
                overlaps
                and (write or other_write)
                and other is not stream
                and stream.clock.get(other.name, 0) < other_clock
            ):
                self.unordered.append(f"{what} on {stream.name} not ordered after {other_what} on {other.name}")
        earlier.append((stream, clock, lo, hi, write, what))

    def cpu_synchronize(self, clock: dict | None) -> None:
        """The CPU waited for ``clock`` (an event, or a stream's work queued so far)."""
        for name, value in (clock or {}).items():
            self.cpu_waited[name] = max(self.cpu_waited.get(name, 0), value)


class SimulatedStream:
    """``moe_lab.optim.offload.host.SideStream``'s interface over a vector clock of a ``Simulation``."""

    simulation: Simulation | None = None
    names = iter(("h2d", "d2h", "steps"))  # the order StreamedStateOptimizer makes its streams in

    def __init__(self, device: torch.device):
        self.__init_named(self.simulation, next(self.names))

    @classmethod
    def named(cls, simulation: Simulation, name: str) -> SimulatedStream:
        stream = cls.__new__(cls)
        stream.__init_named(simulation, name)
        return stream

    def __init_named(self, simulation: Simulation, name: str) -> None:
        self.sim, self.name, self.clock = simulation, name, {name: 0}

    def tick(self) -> int:
        self._merge(self.sim.cpu_waited)
        self.clock[self.name] += 1
        return self.clock[self.name]

    def _merge(self, clock: dict | None) -> None:
        for name, value in (clock or {}).items():
            self.clock[name] = max(self.clock.get(name, 0), value)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after_current: bool = True) -> None:
        if after_current:
            self.after_current()
        with self.use():
            self.sim.access(src, False, f"copy from {tuple(src.shape)}")
            self.sim.access(dst, True, f"copy into {tuple(dst.shape)}")
        dst.copy_(src)

    def record(self) -> dict:
        return dict(self.clock)

    def wait(self, event: dict | None) -> None:
        self._merge(event)

    def wait_stream_of(self, other: SimulatedStream) -> None:
        self._merge(other.clock)

    def after_current(self) -> None:
        self._merge(self.sim.current[-1].clock)

    def then_current(self) -> None:
        self.sim.current[-1]._merge(self.clock)

    @contextlib.contextmanager
    def use(self):
        self.sim.current.append(self)
        try:
            yield
        finally:
            self.sim.current.pop()

    def keep_for(self, t: torch.Tensor) -> None:
        pass  # memory reuse after a free is the allocator's (record_stream); the ring's first use is logged instead

    def synchronize(self) -> None:
        self.sim.cpu_synchronize(self.clock)


@pytest.fixture
def simulation(monkeypatch):
    sim = Simulation()
    monkeypatch.setattr(SimulatedStream, "simulation", sim)
    monkeypatch.setattr(SimulatedStream, "names", iter(("h2d", "d2h", "steps")))
    monkeypatch.setattr(streamed, "SideStream", SimulatedStream)
    monkeypatch.setattr(streamed, "synchronize", sim.cpu_synchronize)
    empty = torch.empty

    def logged_empty(*args, **kwargs):  # the ring (the only allocation given a device): its memory's last user
        t = empty(*args, **kwargs)
        if "device" in kwargs and kwargs.get("dtype") == torch.uint8:
            sim.access(t, True, "the ring's memory, last used on its allocating stream")
        return t

    monkeypatch.setattr(streamed.torch, "empty", logged_empty)
    step_chunk = streamed.StreamedStateOptimizer._step_chunk

    def logged_step_chunk(self, chunk):
        def touch(what):
            for piece, shard in zip(chunk.pieces, chunk.shards):
                sim.access(piece.of(local_shard(piece.param)), True, f"{what}: a weight")
                if piece.param.grad is not None:
                    sim.access(piece.of(local_shard(piece.param.grad)), False, f"{what}: a gradient")
                for value in chunk.optimizer.state.get(shard, {}).values():
                    if torch.is_tensor(value) and value.dim() > 0:
                        sim.access(value, True, f"{what}: its state")

        touch("a chunk's step")
        step_chunk(self, chunk)
        touch("a chunk's step")  # state it created

    monkeypatch.setattr(streamed.StreamedStateOptimizer, "_step_chunk", logged_step_chunk)
    return sim


class _Gated(nn.Module):
    """``b`` joins the forward from step 1 on, only in a step's first micro-batch (state that grows, a gradient the
    last backward does not reach); ``c`` is large enough to be stepped in pieces."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c, self.d = (
            nn.Linear(4, 16),
            nn.Linear(16, 16, bias=False),
            nn.Linear(16, 16),
            nn.Linear(16, 4),
        )

    def forward(self, x: torch.Tensor, step: int, micro_batch: int) -> torch.Tensor:
        x = torch.tanh(self.a(x))
        if step >= 1 and micro_batch == 0:
            x = torch.tanh(self.b(x))
        return self.d(torch.tanh(self.c(x)))


def _train(sim: Simulation, steps: int = 5) -> streamed.StreamedStateOptimizer:
    model = _Gated()
    for p in model.parameters():  # registered first: runs before the optimizer's hook
        p.register_post_accumulate_grad_hook(lambda p: sim.access(p.grad, True, "backward: a gradient"))
    offload = OptimizerOffload(chunk_mib=96 * 4 / 2**20, max_inflight=2)
    optimizer = offload.build(model, functools.partial(torch.optim.AdamW, lr=1e-2), torch.float32)
    assert any(not piece.whole for chunk in optimizer.chunks for piece in chunk.pieces)
    assert (optimizer.h2d.name, optimizer.d2h.name, optimizer.steps.name) == ("h2d", "d2h", "steps")
    for step in range(steps):
        for micro_batch in range(2):
            offload.before_micro_batch(optimizer, final=micro_batch == 1)
            for p in model.parameters():
                sim.access(p, False, "forward: a weight")
            generator = torch.Generator().manual_seed(10 * step + micro_batch)
            inputs, targets = torch.randn(8, 4, generator=generator), torch.randn(8, 4, generator=generator)
            F.mse_loss(model(inputs, step, micro_batch), targets).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:  # as a resumed run does
            optimizer.load_state_dict(optimizer.state_dict())
    optimizer.state_dict()
    for chunk in optimizer.chunks:  # what state_dict() hands out: read by the CPU
        sim.current.append(SimulatedStream.named(sim, "cpu"))
        sim.current[-1].tick()
        sim.access(chunk.host, False, "the CPU reading state_dict()")
        sim.current.pop()
    return optimizer


def test_every_access_to_the_ring_host_state_weights_and_gradients_is_ordered(simulation):
    optimizer = _train(simulation)
    assert optimizer.ring.numel() < sum(c.nbytes for c in optimizer.chunks)  # the ring's room is reused
    assert sum(len(v) for v in simulation.accesses.values()) > 100
    assert not simulation.unordered, "\n".join(dict.fromkeys(simulation.unordered))


@pytest.mark.parametrize("broken", ["h2d_ignores_events", "no_then_current", "steps_ignore_gradients"])
def test_the_simulation_finds_a_missing_ordering(simulation, monkeypatch, broken):
    """The check above can fail: each ordering taken away is reported."""
    if broken == "h2d_ignores_events":
        wait = SimulatedStream.wait
        monkeypatch.setattr(
            SimulatedStream, "wait", lambda self, event: None if self.name == "h2d" else wait(self, event)
        )
    elif broken == "no_then_current":
        monkeypatch.setattr(SimulatedStream, "then_current", lambda self: None)
    else:
        after = SimulatedStream.after_current
        monkeypatch.setattr(
            SimulatedStream, "after_current", lambda self: None if self.name == "steps" else after(self)
        )
    _train(simulation)
    assert simulation.unordered


def test_a_stateless_optimizer_leaves_no_regions_in_the_ring():
    """SignSGD keeps no state: nothing goes through the ring, and no placements pile up step after step."""
    model = _Gated()
    offload = OptimizerOffload(chunk_mib=96 * 4 / 2**20, max_inflight=2)
    optimizer = offload.build(model, functools.partial(SignSGD, lr=1e-2), torch.float32)
    for step in range(3):
        offload.before_micro_batch(optimizer, final=True)
        model(torch.randn(8, 4), step, 1).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.ring.numel() == 0 and not optimizer.regions
