"""The fused gpu backend's overlap schedule on CPU, at EP=4 and EP=8 from every rank's layout (computed from the
gathered counts in one process, as tests/test_fused_reference.py's EP=8 size test does): the spans it pipelines cover
each rank's receive buffer exactly once, in order, aligned, at most ``chunks`` of them and none empty; each span's
grouped GEMMs (offsets clipped to the span) together give every live row exactly the per-expert matmul the reference
backend computes, for the forward (``nt``) and input-gradient (``nn``) GEMMs, with spans that cut through expert
segments; each slot's chunk on its owner, computed on the device for the chunked combine, is the owner's own. The
kernels around the GEMMs run the same schedule under Triton's interpreter in tests/test_fused_kernels.py.
"""

from __future__ import annotations

import pytest
import torch

from moe_lab.moe.fused.layout import chunk_bounds, chunk_spans, layout_from_counts, slot_chunks
from tests.fused_cases import ROUTINGS, routing

pytest.importorskip("triton")

E, K, T, H, N = 16, 4, 24, 8, 16  # H, N: multiples of 8 (torch._grouped_mm's row strides)


def segments(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0, *ends[:-1]], ends))


@pytest.mark.parametrize("ep", [4, 8])
@pytest.mark.parametrize("align", [1, 8])
def test_spans_cover_each_row_once_and_give_the_reference_gemms(ep, align):
    from moe_lab.moe.fused.gpu import _Gemms

    local = E // ep
    gen = torch.Generator().manual_seed(ep)
    w_nt, w_nn = torch.randn(local, N, H, generator=gen), torch.randn(local, N, H, generator=gen)
    checked_cuts = 0
    for kind in ROUTINGS:
        all_ids = [routing(kind, r, T, E, K) for r in range(ep)]
        all_counts = torch.stack([torch.bincount(ids.reshape(-1), minlength=E) for ids in all_ids])
        for rank in range(ep):
            layout = layout_from_counts(all_ids[rank], all_counts, rank, align)
            rows, offs = layout.rows, layout.offs
            for chunks in (1, 2, 3, 4):
                spans = [(start, end) for _, start, end in chunk_spans(rows, chunks, align)]
                case = f"{kind} rank {rank} chunks {chunks}: {spans} of {rows} rows"
                assert 1 <= len(spans) <= chunks and spans[0][0] == 0 and spans[-1][1] == rows, case
                assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), case
                assert all(end > start and start % align == 0 for start, end in spans), case
                lengths = [end - start for start, end in spans]
                assert max(lengths) - min(lengths) <= align, case  # even, whatever the skew

                # Every live row computed exactly once: rows start as NaN, each span writes its own.
                gemms = _Gemms("gpu", offs, None)
                a, b = torch.randn(rows, H, generator=gen), torch.randn(rows, N, generator=gen)
                got_nt, got_nn = torch.full((rows, N), float("nan")), torch.full((rows, H), float("nan"))
                group_rows = torch.zeros(local, dtype=torch.int64)
                for start, end in spans:
                    span = gemms.span(start, end)
                    # A grouped GEMM's offsets: non-decreasing, within the span (CUDA reads past it otherwise).
                    ends = span.offs.long()
                    assert span.offs.dtype == torch.int32 and (ends.diff() >= 0).all() and 0 <= ends.min() <= ends.max() <= end - start, case
                    group_rows += ends.diff(prepend=ends.new_zeros(1))
                    span.nt(a[start:end], w_nt, out=got_nt[start:end])
                    span.nn(b[start:end], w_nn, out=got_nn[start:end])
                    cut = [s for s, e in segments(offs) if start < s < end or start < e < end]
                    checked_cuts += bool(cut)
                assert group_rows.tolist() == offs.long().diff(prepend=offs.new_zeros(1).long()).tolist(), case
                for j, (s, e) in enumerate(segments(offs)):
                    torch.testing.assert_close(got_nt[s:e], a[s:e] @ w_nt[j].T, msg=f"{case} nt expert {j}")
                    torch.testing.assert_close(got_nn[s:e], b[s:e] @ w_nn[j], msg=f"{case} nn expert {j}")
    assert checked_cuts  # some span boundary fell inside an expert segment


@pytest.mark.parametrize("ep", [4, 8])
def test_each_slot_knows_its_chunk_on_its_owner(ep):
    """What the chunked combine reads: for every slot of every rank, the chunk of its owner's buffer its row lands in,
    computed on the device from every rank's size, equals the owner's own chunk bounds (the ones it computes in)."""
    align, local = 8, E // ep
    for kind in ROUTINGS:
        all_ids = [routing(kind, r, T, E, K) for r in range(ep)]
        all_counts = torch.stack([torch.bincount(ids.reshape(-1), minlength=E) for ids in all_ids])
        layouts = [layout_from_counts(all_ids[r], all_counts, r, align) for r in range(ep)]
        assert [int(n) for n in layouts[0].all_rows] == [lay.rows for lay in layouts], kind
        for chunks in (1, 2, 3, 4):
            bounds = [chunk_bounds(lay.rows, chunks, align) for lay in layouts]
            for rank, lay in enumerate(layouts):
                dest = all_ids[rank] // local
                got = slot_chunks(lay, dest, chunks, align)
                for (t, k), owner in zip(torch.cartesian_prod(torch.arange(T), torch.arange(K)).tolist(), dest.reshape(-1).tolist()):
                    b, p = bounds[owner], int(lay.pos[t, k])
                    assert b[got[t, k]] <= p < b[got[t, k] + 1], (kind, rank, chunks, t, k)


def test_spans_of_an_empty_or_tiny_buffer():
    """A rank that receives nothing still has one aligned block: one span; fewer blocks than chunks: one per block."""
    assert chunk_spans(8, 4, 8) == [(0, 0, 8)]
    assert chunk_bounds(24, 4, 8) == [0, 8, 16, 24, 24] and chunk_spans(24, 4, 8) == [(0, 0, 8), (1, 8, 16), (2, 16, 24)]
    assert [s[1:] for s in chunk_spans(131072, 4, 128)] == [(0, 32768), (32768, 65536), (65536, 98304), (98304, 131072)]
