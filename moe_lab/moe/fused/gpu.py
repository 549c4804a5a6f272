"""The ``gpu`` backend: Triton dispatch / SwiGLU / combine kernels around grouped GEMMs, with one host sync per
forward (the receive-buffer sizes, ``moe_lab.moe.fused.layout``) and none in backward.

Forward, per rank: the routing layout (counts gathered device to device at EP > 1, sizes copied to the host); each
slot tells its owner where it comes from (``push_slots``: a few bytes per slot, written straight into the owner's
buffer); the owner pulls each routed row into its expert-contiguous, GEMM-aligned receive buffer (``pull_rows``);
gate/up GEMM; SwiGLU with the routing weight folded in; down GEMM, straight into the buffer peers combine from; each
token sums its K rows from wherever they were computed (``combine``). Backward mirrors it: dy is pulled like x, dx
and the routing-weight gradients are gathered like y.

The exchange overlaps the compute (``chunks`` > 1): every receive buffer is cut into ``chunks`` chunks of rows
(``layout.chunk_bounds``); a side stream pulls chunk after chunk while the main stream runs each chunk's GEMMs and
SwiGLU as soon as its rows have landed (an event per chunk), and combines chunk c (each token adds the rows it has in
chunk c of any rank, into fp32 partial sums) once every rank has computed it, while chunk c+1 computes; at EP>1 the
GEMMs leave ``EXCHANGE_SMS`` SMs to the side stream. In backward dy is pulled the same way, and the dx and
routing-weight combines run on the side stream while the two weight-gradient GEMMs run on the main one. Barriers run
on the main stream before the side stream starts and on the side stream after it has, never on both at once, so they
pair up across ranks in program order; every rank makes the same ones, whatever chunks its rows fall in.

Every receive-side buffer (the routed rows, gate/up, the activations, the GEMM outputs, what is saved for backward)
holds exactly this rank's received rows plus per-expert alignment. At EP > 1 the buffers that peers read or write
are torch symmetric memory (CUDA backend, NVLink peer access; multicast stays off), reused across calls (see
``_Exchange``); device-side barriers order the phases.
``gpu_deep_gemm`` runs the forward and input-gradient GEMMs with DeepGEMM's m-grouped contiguous bf16 kernels;
weight gradients always use ``torch._grouped_mm`` (DeepGEMM's k-grouped kernel takes its group sizes on the host).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import triton

from moe_lab.moe.fused import kernels
from moe_lab.moe.fused.layout import chunk_spans, routing_layout, slot_chunks, workspace_rows

ROW_BLOCK = 1024  # columns per program of the row kernels
SLOT_BLOCK = 1024
IDLE_PROGRAMS_PER_EXPERT = 16
# SMs the grouped GEMMs leave free while a pull or combine over NVLink runs beside them on the side stream (DeepEP's
# default for its intranode kernels; not tuned here). At EP=1 the pulls are local copies at HBM speed: they take the
# gaps between kernels, and the GEMMs keep every SM.
EXCHANGE_SMS = 20


# --- grouped GEMMs -------------------------------------------------------------------------------------------------


class _Gemms:
    """The grouped GEMMs over a receive buffer, or over one span of its rows (``span``)."""

    def __init__(self, backend: str, offs: torch.Tensor, row_src: torch.Tensor, m_indices: torch.Tensor | None = None):
        self.offs, self.backend = offs, backend
        self.deep = backend == "gpu_deep_gemm"
        if self.deep:
            import deep_gemm

            self.dg = deep_gemm
            if m_indices is None:
                rows = torch.arange(row_src.numel(), device=offs.device, dtype=torch.int32)
                expert = torch.searchsorted(offs, rows, right=True).to(torch.int32)
                m_indices = torch.where(row_src >= 0, expert, -1).to(torch.int32)
            self.m_indices = m_indices

    def span(self, start: int, end: int) -> _Gemms:
        """The GEMMs over rows [start, end) alone: each expert's segment end taken relative to ``start`` and clipped
        to the span (experts before it end at 0, those after it at its length: empty groups), DeepGEMM's per-row
        expert indices sliced. ``start`` is a multiple of the alignment, so no aligned block straddles two spans."""
        offs = (self.offs - start).clamp_(0, end - start)
        return _Gemms(self.backend, offs, None, self.m_indices[start:end] if self.deep else None)

    def nt(self, a, w, out=None):
        """a [C, K] @ w[e].T for w [L, N, K]: the forward projections, weights as stored; into ``out`` if given."""
        if self.deep:
            out = a.new_empty(a.shape[0], w.shape[1]) if out is None else out
            self.dg.m_grouped_bf16_gemm_nt_contiguous(a, w, out, self.m_indices)
            return out
        return _into(torch._grouped_mm(a, w.transpose(-2, -1), offs=self.offs), out)

    def nn(self, a, w, out=None):
        """a [C, N] @ w[e] for w [L, N, K]: the input gradients; into ``out`` if given."""
        if self.deep:
            out = a.new_empty(a.shape[0], w.shape[2]) if out is None else out
            self.dg.m_grouped_bf16_gemm_nn_contiguous(a, w, out, self.m_indices)
            return out
        return _into(torch._grouped_mm(a, w, offs=self.offs), out)

    @contextlib.contextmanager
    def leaving_sms(self, sms: int):
        """The GEMMs launched inside run on all SMs but ``sms``. ``torch._grouped_mm``'s CUTLASS kernels and
        DeepGEMM's are persistent, one block per SM that holds its registers: without this a kernel on another stream
        gets an SM only when a GEMM has finished."""
        if sms == 0:
            yield
            return
        carveout = torch._C._get_sm_carveout_experimental()
        torch._C._set_sm_carveout_experimental(sms)
        if self.deep:
            num_sms = self.dg.get_num_sms()
            self.dg.set_num_sms(num_sms - sms)
        try:
            yield
        finally:
            torch._C._set_sm_carveout_experimental(carveout)
            if self.deep:
                self.dg.set_num_sms(num_sms)

    def wgrad(self, grad, inp):
        """sum over each expert's rows of grad^T inp -> [L, N, K] (k-grouped)."""
        out = torch._grouped_mm(grad.t(), inp, offs=self.offs)
        slab = out[0].numel()
        per_program = triton.cdiv(slab, IDLE_PROGRAMS_PER_EXPERT)
        kernels.zero_idle_experts_kernel[(out.shape[0], IDLE_PROGRAMS_PER_EXPERT)](
            out, self.offs, SLAB=slab, PER_PROGRAM=per_program, BLOCK=ROW_BLOCK
        )
        return out


def _into(result, out):
    """``torch._grouped_mm`` has no ``out=``: a span's result is copied into its rows of the whole buffer."""
    if out is None:
        return result
    return out.copy_(result)


class _Streams:
    """The main (current) stream and a side stream for the exchange, per device. With ``overlap`` off (chunks=1), and
    on CPU (the Triton interpreter's tests) where there are no streams, the same calls run in program order on the
    main stream, which is one of the orders the events allow.

    Every tensor the side stream touches is allocated on the main stream before the side stream starts, and the main
    stream waits for the side stream (``join``, or the event of the last span) before the op returns, so nothing the
    side stream uses can be freed and reused under it (no ``record_stream``)."""

    _side: dict = {}  # device -> torch.cuda.Stream

    def __init__(self, device: torch.device, overlap: bool, peer: bool):
        self.overlap, self.peer = overlap, peer
        self.cuda = overlap and device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            if device not in self._side:
                self._side[device] = torch.cuda.Stream(device)
            self.side_stream = self._side[device]

    @contextlib.contextmanager
    def side(self):
        """Kernels launched inside run on the side stream, after everything launched on the main stream so far."""
        if not self.cuda:
            yield
            return
        self.side_stream.wait_stream(self.main)
        with torch.cuda.stream(self.side_stream):
            yield

    def mark(self):
        """An event at this point of the current stream (None without streams)."""
        return torch.cuda.current_stream().record_event() if self.cuda else None

    def wait(self, event) -> None:
        """The main stream runs what comes next after ``event``."""
        if event is not None:
            self.main.wait_event(event)

    def join(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.side_stream)

    def exchange_sms(self) -> int:
        """SMs the GEMMs leave to a side-stream kernel that reads peers' memory beside them."""
        return EXCHANGE_SMS if self.overlap and self.peer else 0


# --- exchange ------------------------------------------------------------------------------------------------------


def symmetric_empty(shape, dtype, device, group):
    """A torch symmetric-memory buffer -> (this rank's tensor, every rank's buffer address as an int64 tensor on
    ``device``, the group's device-side barrier). Collective: every rank allocates the same shape in the same order.
    tests/test_fused_kernels.py swaps in shared file mappings to run the peer paths on CPU."""
    import torch.distributed._symmetric_memory as symm_mem

    local = symm_mem.empty(shape, dtype=dtype, device=device)
    handle = symm_mem.rendezvous(local, group.group_name)
    ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
    return local, ptrs, functools.partial(handle.barrier, channel=0)


class _Exchange:
    """Where rows live. EP=1: local tensors. EP>1: symmetric-memory buffers that peers read or write, of two kinds.

    Sized by this rank's tokens (``x``, ``dy`` [T, H]): one per shape. Receive side (``row_src``, ``row_weight``,
    ``d_row_weight`` [P], ``out`` [P, H]: the expert outputs in forward, the input gradients in backward, never live at
    once): P rows shared by every layer, each call using its first ``rows``. P is the largest receive buffer over the
    group rounded up the 1.25x ladder (``workspace_rows``); it only grows, and only in forward right after the
    layout's host sync (``reserve``), so every rank allocates the same sizes in the same order, backward never
    allocates, and freeing the smaller buffers cannot pull memory from under a peer: that sync waited for the count
    all-gather, which no peer finishes before its stream has run every earlier kernel that touched this rank's buffers.
    """

    _buffers: dict = {}  # key -> (local tensor, peer pointers, barrier)
    _workspace_rows: dict = {}  # (device, group name) -> P

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device):
        self.group, self.device = group, device
        self.peer = group is not None
        self.rank = dist.get_rank(group) if self.peer else 0
        if self.peer:
            self.place = (self.device, self.group.group_name)
            self.barrier = self._symmetric(("sync", (1,), torch.int32), (1,), torch.int32)[2]

    def _symmetric(self, key, shape, dtype):
        """The buffer of ``key`` (+ this device and group), allocated with ``shape`` and ``dtype`` on first use."""
        key = (*key, *self.place)
        if key not in self._buffers:
            self._buffers[key] = symmetric_empty(shape, dtype, self.device, self.group)
        return self._buffers[key]

    def buffer(self, name, shape, dtype):
        """A buffer sized by this rank's tokens -> (local tensor, device tensor of every rank's buffer address)."""
        return self._symmetric((name, tuple(shape), dtype), shape, dtype)[:2]

    def reserve(self, max_rows: int, width: int, dtype: torch.dtype):
        """Forward, after the layout's host sync (every rank passes the same values): the receive-side buffers hold
        at least ``max_rows`` rows."""
        if not self.peer:
            return
        held = self._workspace_rows.get(self.place, 0)
        if max_rows > held:
            held = self._workspace_rows[self.place] = workspace_rows(max_rows)
            for key in [k for k in self._buffers if k[0] == "workspace" and k[-2:] == self.place]:
                del self._buffers[key]  # before allocating the larger one: the two never coexist
                _, _, row_shape, row_dtype = key[:-2]
                self._symmetric(key[:-2], (held, *row_shape), row_dtype)
        for name, row_shape, row_dtype in (
            ("row_src", (), torch.int64), ("row_weight", (), torch.float32), ("d_row_weight", (1,), torch.float32),
            ("out", (width,), dtype),
        ):
            self._symmetric(("workspace", name, row_shape, row_dtype), (held, *row_shape), row_dtype)

    def workspace(self, name, rows, row_shape, dtype):
        """The first ``rows`` of a receive-side buffer -> (local view, peer pointers)."""
        local, ptrs, _ = self._buffers[("workspace", name, tuple(row_shape), dtype, *self.place)]
        if rows > local.shape[0]:
            raise RuntimeError(f"fused MoE: {rows} received rows overflow the {local.shape[0]}-row {name} buffer")
        return local[:rows], ptrs

    def publish(self, name, tensor):
        """Make a local tensor readable by peers: (local, peer pointers); at EP=1 the tensor itself."""
        if not self.peer:
            return tensor, tensor
        local, ptrs = self.buffer(name, tensor.shape, tensor.dtype)
        local.copy_(tensor)
        return local, ptrs

    def route(self, pos, dest, weights, rows, num_tokens):
        """Each slot writes (source rank, token) and its weight into its owner's row. -> row_src, row_weight."""
        top_k = pos.shape[1]
        with_weight = weights is not None
        if self.peer:
            row_src, src_ptrs = self.workspace("row_src", rows, (), torch.int64)
            row_weight, weight_ptrs = self.workspace("row_weight", rows, (), torch.float32)
            row_src.fill_(-1)
            row_weight.zero_()
            self.barrier()  # every owner has cleared its rows before anyone writes into them
        else:
            row_src = torch.full((rows,), -1, dtype=torch.int64, device=self.device)
            row_weight = torch.zeros(rows, dtype=torch.float32, device=self.device)
            src_ptrs = weight_ptrs = row_src
        num_slots = pos.numel()
        kernels.push_slots_kernel[(triton.cdiv(num_slots, SLOT_BLOCK),)](
            row_src, src_ptrs, row_weight, weight_ptrs, pos, dest, weights if with_weight else pos,
            num_slots, top_k, num_tokens, self.rank, PEER=self.peer, WITH_WEIGHT=with_weight, BLOCK=SLOT_BLOCK,
        )
        if self.peer:
            self.barrier()  # all slots have arrived
            return row_src.clone(), row_weight.clone()
        return row_src, row_weight

    def publish_rows(self, name, src):
        """Dispatch, first half: this rank's rows ``src`` [T, D], readable by every peer once this returns (on the
        current stream) -> (local, peer pointers)."""
        local, ptrs = self.publish(name, src)
        if self.peer:
            self.barrier()  # every peer has published
        return local, ptrs

    def pull_rows(self, out, local, ptrs, row_src, offs):
        """Dispatch, second half, for a span of the receive buffer: out [n, D] = the source rows of ``row_src`` [n]
        (``offs``: the span's expert segment ends, for which rows are live)."""
        grid = (row_src.shape[0], triton.cdiv(out.shape[1], ROW_BLOCK))
        kernels.gather_rows_kernel[grid](
            out, local, ptrs, row_src, offs, offs.numel(), local.shape[0], out.shape[1], PEER=self.peer, BLOCK=ROW_BLOCK
        )

    def combine_buffer(self, name, rows, row_shape, dtype):
        """Where the rows to combine are written: at EP>1 the first ``rows`` of the workspace buffer ``name``, which
        peers read; at EP=1 a new tensor. -> (local [rows, *row_shape], peer pointers)."""
        if self.peer:
            return self.workspace(name, rows, row_shape, dtype)
        local = torch.empty(rows, *row_shape, dtype=dtype, device=self.device)
        return local, local

    def combine(self, out, buf, ptrs, pos, dest, chunked=None):
        """Gather-sum by slot group: out[i] = sum_j buf_{dest[i, j]}[pos[i, j]] for pos [N, J]; ``buf`` [rows, D] from
        ``combine_buffer``, complete on this rank's current stream. ``chunked`` = (acc, slot_chunk, chunk, chunks):
        add only the slots whose row is in chunk ``chunk`` of its owner's buffer onto ``acc`` ([N, D] fp32), writing
        ``out`` at the last chunk; every rank calls it for every chunk in order, each once that chunk's rows are
        complete on its stream (so every rank makes the same barriers, whatever chunks it has rows in)."""
        acc, slot_chunk, chunk, chunks = chunked if chunked is not None else (out, pos, 0, 1)
        if self.peer:
            self.barrier()  # every peer's rows (of this chunk) are complete
        grid = (pos.shape[0], triton.cdiv(buf.shape[1], ROW_BLOCK))
        kernels.combine_kernel[grid](
            out, acc, buf, ptrs, pos, dest, slot_chunk, chunk, buf.shape[1], TOP_K=pos.shape[1], PEER=self.peer,
            CHUNKED=chunked is not None, FIRST=chunk == 0, LAST=chunk == chunks - 1, BLOCK=ROW_BLOCK,
        )
        if self.peer and chunk == chunks - 1:
            self.barrier()  # peers are done reading this rank's buffer before anyone reuses it
        return out


# --- the op --------------------------------------------------------------------------------------------------------


def _swiglu_block(inter: int) -> int:
    return min(ROW_BLOCK, triton.next_power_of_2(inter))


def _pull_spans(ex, streams, name, src, out, row_src, gemms, spans):
    """Publish ``src`` and pull each span's rows of the receive buffer ``out`` on the side stream, span after span.
    -> per span, (its GEMMs, the event its rows have landed at)."""
    local, ptrs = ex.publish_rows(name, src)  # on the main stream: the barrier orders the pulls after every peer's publish
    span_gemms = [gemms.span(start, end) for _, start, end in spans]
    landed = []
    with streams.side():
        for (_, start, end), g in zip(spans, span_gemms):
            ex.pull_rows(out[start:end], local, ptrs, row_src[start:end], g.offs)
            landed.append(streams.mark())
    return list(zip(span_gemms, landed))


def forward(x, topk_ids, topk_weights, gate_up_proj, down_proj, num_experts, group, align, backend, chunks):
    num_tokens, top_k = topk_ids.shape
    inter = down_proj.shape[2]
    layout = routing_layout(topk_ids, num_experts, align, group)  # the host sync: buffer sizes
    rows = layout.rows
    dest = (topk_ids // gate_up_proj.shape[0]).to(torch.int32)
    ex = _Exchange(group, x.device)
    streams = _Streams(x.device, chunks > 1, ex.peer)
    ex.reserve(layout.max_rows, x.shape[1], x.dtype)
    row_src, row_weight = ex.route(layout.pos, dest, topk_weights.contiguous(), rows, num_tokens)
    gemms = _Gemms(backend, layout.offs, row_src)
    spans = chunk_spans(rows, chunks, align)
    x_routed = x.new_empty(rows, x.shape[1])
    # With one span the GEMM's own output is the residual: torch._grouped_mm has no out=, a span's is copied in.
    gate_up = x.new_empty(rows, gate_up_proj.shape[1]) if len(spans) > 1 else None
    act = x.new_empty(rows, inter)
    out, out_ptrs = ex.combine_buffer("out", rows, (x.shape[1],), x.dtype)
    y = x.new_empty(x.shape)
    if chunks > 1:  # chunk c is combined on the side stream once every rank has computed it
        chunked = [torch.empty(x.shape, dtype=torch.float32, device=x.device), slot_chunks(layout, dest, chunks, align)]
    block = _swiglu_block(inter)
    # Span c's GEMMs run on the main stream while span c+1's rows are pulled and chunk c-1 is combined on the side one.
    pulled = dict(zip((c for c, _, _ in spans), _pull_spans(ex, streams, "x", x.contiguous(), x_routed, row_src, gemms, spans)))
    starts = dict((c, (start, end)) for c, start, end in spans)
    for c in range(chunks):
        if c in pulled:
            (g, landed), (start, end) = pulled[c], starts[c]
            streams.wait(landed)
            with g.leaving_sms(streams.exchange_sms()):
                span_gate_up = g.nt(x_routed[start:end], gate_up_proj, out=None if gate_up is None else gate_up[start:end])
                kernels.swiglu_forward_kernel[(end - start, triton.cdiv(inter, block))](
                    act[start:end], span_gate_up, row_weight[start:end], row_src[start:end], g.offs, g.offs.numel(),
                    inter, BLOCK=block,
                )
                g.nt(act[start:end], down_proj, out=out[start:end])
        if chunks > 1:
            with streams.side():
                ex.combine(y, out, out_ptrs, layout.pos, dest, (*chunked, c, chunks))
    if chunks == 1:
        ex.combine(y, out, out_ptrs, layout.pos, dest)
    streams.join()
    gate_up = span_gate_up if gate_up is None else gate_up
    return y, x_routed, gate_up, row_weight, layout.pos, layout.offs


def backward(dy, x_routed, gate_up, row_weight, pos, offs, topk_ids, gate_up_proj, down_proj, group, align, backend, chunks):
    num_tokens, top_k = pos.shape
    rows, inter = gate_up.shape[0], down_proj.shape[2]  # rows: forward's receive buffer, known on the host: no sync
    dest = (topk_ids // gate_up_proj.shape[0]).to(torch.int32)
    ex = _Exchange(group, dy.device)
    streams = _Streams(dy.device, chunks > 1, ex.peer)
    row_src, _ = ex.route(pos, dest, None, rows, num_tokens)
    gemms = _Gemms(backend, offs, row_src)
    dy_routed = dy.new_empty(rows, dy.shape[1])
    d_gate_up = torch.empty_like(gate_up)
    act_weighted = dy.new_empty(rows, inter)
    dx_routed, dx_ptrs = ex.combine_buffer("out", rows, (dy.shape[1],), dy.dtype)
    d_row_weight, d_weight_ptrs = ex.combine_buffer("d_row_weight", rows, (1,), torch.float32)
    dx = dy.new_empty(dy.shape)
    d_weights = torch.empty(pos.numel(), 1, dtype=torch.float32, device=dy.device)
    block = _swiglu_block(inter)
    spans = chunk_spans(rows, chunks, align)
    pulled = _pull_spans(ex, streams, "dy", dy, dy_routed, row_src, gemms, spans)
    for c, ((_, start, end), (g, landed)) in enumerate(zip(spans, pulled)):
        streams.wait(landed)
        with g.leaving_sms(streams.exchange_sms() if c + 1 < len(spans) else 0):
            d_act_weighted = g.nn(dy_routed[start:end], down_proj)
            kernels.swiglu_backward_kernel[(end - start,)](
                d_gate_up[start:end], act_weighted[start:end], d_row_weight[start:end], gate_up[start:end], d_act_weighted,
                row_weight[start:end], row_src[start:end], g.offs, g.offs.numel(), INTER=inter, BLOCK=block,
            )
            g.nn(d_gate_up[start:end], gate_up_proj, out=dx_routed[start:end])
    # The combines (dx, routing-weight gradients) run on the side stream while the weight gradients run on this one.
    with streams.side():
        ex.combine(dx, dx_routed, dx_ptrs, pos, dest)
        ex.combine(d_weights, d_row_weight, d_weight_ptrs, pos.view(-1, 1), dest.view(-1, 1))
    with gemms.leaving_sms(streams.exchange_sms()):
        d_down_proj = gemms.wgrad(dy_routed, act_weighted)
        d_gate_up_proj = gemms.wgrad(d_gate_up, x_routed)
    streams.join()
    return dx, d_weights.view(num_tokens, top_k), d_gate_up_proj, d_down_proj
