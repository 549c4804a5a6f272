"""``to_host``: a device tensor's values read by a kernel storing into pinned memory, not queued behind bulk copies."""

from __future__ import annotations

import pytest
import torch

from moe_lab.runtime.host_read import to_host
from tests.interpreted import interpreted


def store_bytes_cases() -> list:
    """``store_bytes`` against ``copy_`` on CPU tensors (run under Triton's interpreter): sizes 0, 1, odd, about and
    past one block, several blocks; bytes past the destination untouched; a non-contiguous float tensor, a bool and
    a bf16 one in their shapes. The failing cases."""
    from moe_lab.runtime.host_read_kernel import BLOCK, store_bytes

    generator = torch.Generator().manual_seed(0)
    failing = []
    for nbytes in [0, 1, 15, BLOCK - 1, BLOCK, BLOCK + 1, 5 * BLOCK + 3]:
        source = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        guarded = torch.randint(0, 256, (nbytes + 64,), dtype=torch.uint8, generator=generator)
        expected = guarded.clone()
        expected[:nbytes].copy_(source)
        store_bytes(guarded.data_ptr(), source)
        if not torch.equal(guarded, expected):
            failing.append(nbytes)
    for name, values in [
        ("float32 transposed", torch.randn(7, 33, generator=generator).t()),
        ("bool", torch.rand(50, generator=generator) > 0.5),
        ("bfloat16", torch.randn(3, 5, generator=generator).bfloat16()),
        ("one element of a column", torch.arange(256).view(2, 128)[:1, -1]),  # stride 128: the fused layout's read
        ("int64 column", torch.arange(256).view(2, 128)[:, -1]),
    ]:
        into = torch.zeros(values.shape, dtype=values.dtype)
        store_bytes(into.data_ptr(), values)
        if not torch.equal(into, values):
            failing.append(name)
    return failing


def test_store_bytes_interpreted_equals_copy():
    assert interpreted("tests.test_host_read:store_bytes_cases") == []


def test_to_host_of_a_host_tensor_is_its_values():
    t = torch.arange(6).view(2, 3)
    assert torch.equal(to_host(t), t)


@pytest.mark.gpu
def test_to_host_on_gpu_equals_cpu_and_does_not_wait_behind_a_copy_home():
    """Values as ``.cpu()`` gives them (dtypes, shapes, a non-contiguous view, after work queued on the stream);
    and a read issued behind 4 GiB going home on another stream returns before that copy has finished (by the copy
    engine it waits for all of it: about 80 ms at PCIe's 55 GB/s)."""
    column = torch.arange(256, device="cuda").view(2, 128)
    for values in [
        torch.arange(5, device="cuda"),
        torch.randn(4, 129, device="cuda").t(),
        torch.ones(3, device="cuda").bool(),
        torch.tensor(2.5, device="cuda").bfloat16(),
        column[:1, -1],
        column[:, -1],
    ]:
        expected = values.cpu()
        got = to_host(values.clone())  # the clone is queued work to wait for
        assert got.dtype == expected.dtype and got.shape == expected.shape and torch.equal(got, expected)
    device_state = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    host_state = torch.empty(4 << 30, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        host_state.copy_(device_state, non_blocking=True)
        gone_home = side.record_event()
    assert to_host(torch.tensor([7], device="cuda")).item() == 7
    assert not gone_home.query(), "the read waited for the copy home"
    gone_home.synchronize()


@pytest.mark.gpu
def test_to_host_compiles_in_one_graph_on_gpu():
    """The torch dispatcher reads its row counts inside a compiled block (EP > 1, fullgraph): there the read is the
    graph's own copy, the values the same."""
    t = torch.arange(6, device="cuda").view(2, 3)
    read = torch.compile(lambda t: to_host(t * 2).unbind(), fullgraph=True)
    assert all(torch.equal(got, want) for got, want in zip(read(t), (t * 2).cpu().unbind()))
