"""A timing model of offload=optimizer's state pipeline (moe_lab/optim/offload/optimizer.py): how much of the state
traffic the last micro-batch's backward and the step's earlier micro-batches can hide, per device ring size.

    python experiments/offload_accum/pipeline_model.py                  # the 4-layer 30B proxy, this study's point
    python experiments/offload_accum/pipeline_model.py --whole --max-inflight 1,2,3,4,5,6

The chunks are the optimizer's own (``chunked_pieces`` over the proxy's parameters in reverse order, ``--chunk-mib``:
AdamW's, which splits larger parameters into pieces of a chunk; ``--whole`` for an optimizer that does not), each
with AdamW's 8 bytes of state per parameter. Time 0 is the start of the last micro-batch's backward, which makes
each chunk's gradients final in order, spread in proportion to parameters over ``--backward-s``; before it the
state may stream in for ``--before-s`` (the step's earlier micro-batches: the forward only at one micro-batch).
Per chunk, in order: its state copies in (PCIe host -> device, one copy at a time) once its place in the ring is
free (the chunks placed there before have gone home); it steps once its state is in and its gradients are final
(28 bytes per parameter at ``--hbm-gbps``, one step at a time); its state copies home (device -> host, one copy at a
time, at the same rate: PCIe is full duplex). Printed: the time the last chunk steps after backward ends (what the
next forward waits for: the exposed cost), and when the last state is home.
"""

from __future__ import annotations

import argparse

import torch

from moe_lab.models.qwen3_moe import Qwen3MoeConfig
from moe_lab.optim.offload.optimizer import chunked_pieces

STATE_BYTES = 8  # AdamW's two fp32 moments per parameter


def exposed(
    chunk_params: list[int], ring_bytes: float, pcie: float, hbm: float, backward_s: float, before_s: float
) -> tuple[float, float]:
    total = sum(chunk_params)
    grads_final, done = [], 0
    for n in chunk_params:
        done += n
        grads_final.append(backward_s * done / total)
    placed: list[tuple[float, float, int]] = []  # (start, end, chunk) in the ring
    home: dict[int, float] = {}
    cursor, h2d_free, d2h_free, step_free, loads = 0.0, -before_s, -before_s, -before_s, {}
    for i, n in enumerate(chunk_params):
        while len(loads) < len(chunk_params):  # load ahead, in order, while the ring has room
            j = len(loads)
            size = chunk_params[j] * STATE_BYTES
            start = cursor if cursor + size <= ring_bytes else 0.0
            covered = [r for r in placed if r[0] < start + size and start < r[1]]
            if any(r[2] not in home for r in covered):
                break
            free_at = max([home[r[2]] for r in covered], default=-before_s)
            placed = [r for r in placed if r not in covered] + [(start, start + size, j)]
            cursor = start + size
            h2d_free = loads[j] = max(h2d_free, free_at) + size / pcie
        stepped = max(loads[i], grads_final[i], step_free) + n * 28 / hbm
        step_free = stepped
        d2h_free = home[i] = max(d2h_free, stepped) + n * STATE_BYTES / pcie
    return step_free - backward_s, max(home.values()) - backward_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--chunk-mib", type=float, default=256.0)
    parser.add_argument("--pcie-gbps", type=float, default=53.0, help="each way (grid_30b: 24.9 GB in about 0.47 s)")
    parser.add_argument("--hbm-gbps", type=float, default=4000.0)
    parser.add_argument(
        "--micro-batch-s", type=float, default=0.182, help="none's s/step per micro-batch (1.455 s / 8)"
    )
    parser.add_argument(
        "--backward-s", type=float, default=0.12, help="a micro-batch's backward (the rest of it is its forward)"
    )
    parser.add_argument("--max-inflight", default="2,4,8,12,16,20,24")
    parser.add_argument(
        "--whole", action="store_true", help="chunks of whole parameters (an optimizer that is not element-wise)"
    )
    args = parser.parse_args()
    with torch.device("meta"):
        model = Qwen3MoeConfig.preset("qwen3_30b", num_layers=args.layers).build()
    pieces = chunked_pieces(
        list(reversed(list(model.parameters()))), int(args.chunk_mib * 2**20) // 4, split=not args.whole
    )
    chunks = [sum(piece.end - piece.start for piece in c) for c in pieces]
    largest = max(chunks) * STATE_BYTES
    pcie, hbm = args.pcie_gbps * 1e9, args.hbm_gbps * 1e9
    state = sum(chunks) * STATE_BYTES
    print(
        f"{len(chunks)} chunks, {sum(chunks) / 1e9:.3f} G parameters, {state / 1e9:.1f} GB of state each way "
        f"({state / pcie:.3f} s at {args.pcie_gbps:.0f} GB/s), largest chunk's state {largest / 1e9:.2f} GB"
    )
    print(
        "| max_inflight | ring GB | exposed s, 8 micro-batches | exposed s, 1 micro-batch | last state home, s after backward |"
    )
    print("|---|---|---|---|---|")
    for k in (int(x) for x in args.max_inflight.split(",")):
        ring = k * largest
        forward = args.micro_batch_s - args.backward_s
        at8, home = exposed(chunks, ring, pcie, hbm, args.backward_s, before_s=7 * args.micro_batch_s + forward)
        at1, _ = exposed(chunks, ring, pcie, hbm, args.backward_s, before_s=forward)
        print(f"| {k} | {ring / 1e9:.1f} | {at8:.3f} | {at1:.3f} | {home:.3f} |")


if __name__ == "__main__":
    main()
