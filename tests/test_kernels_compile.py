"""Every Triton kernel of moe_lab compiled for the H200 (sm_90) on CPU, by Triton's compiler and its own ptxas: the
interpreted CPU tests check the kernels' values, not that they compile for a GPU, nor what they cost there. Each must
compile, as launched (signature, compile-time constants, warps), without spilling registers."""

from __future__ import annotations

import importlib
import os
import subprocess

import pytest

pytestmark = pytest.mark.slow  # compiles each kernel for the H200 with Triton's ptxas

triton = pytest.importorskip("triton")

PEERS = {"PEER": True}  # the peer path: pointers read from a table, the larger kernel
KERNELS = {  # (module, kernel): (run-time argument types, compile-time constants, warps)
    ("moe_lab.moe.fused.kernels", "push_slots_kernel"): (
        {
            "row_src_ptr": "*i64",
            "row_src_peers": "*i64",
            "row_weight_ptr": "*fp32",
            "row_weight_peers": "*i64",
            "pos_ptr": "*i64",
            "ids_ptr": "*i64",
            "weight_ptr": "*bf16",
            "num_slots": "i32",
            "top_k": "i32",
            "rows_per_rank": "i32",
            "my_rank": "i32",
            "local_experts": "i32",
        },
        {**PEERS, "BLOCK": 1024},
        4,
    ),
    ("moe_lab.moe.fused.kernels", "gather_rows_kernel"): (
        {
            "out_ptr": "*bf16",
            "src_ptr": "*bf16",
            "src_peers": "*i64",
            "row_src_ptr": "*i64",
            "offs_ptr": "*i32",
            "num_local_experts": "i32",
            "rows_per_rank": "i32",
            "width": "i32",
        },
        {**PEERS, "BLOCK": 1024},
        4,
    ),
    ("moe_lab.moe.fused.kernels", "combine_kernel"): (
        {
            "out_ptr": "*bf16",
            "buf_ptr": "*bf16",
            "buf_peers": "*i64",
            "pos_ptr": "*i64",
            "ids_ptr": "*i64",
            "local_experts": "i32",
            "width": "i32",
        },
        {"TOP_K": 8, **PEERS, "BLOCK": 1024},
        4,
    ),
    ("moe_lab.moe.fused.kernels", "swiglu_forward_kernel"): (
        {
            "act_ptr": "*bf16",
            "gate_up_ptr": "*bf16",
            "row_weight_ptr": "*fp32",
            "row_src_ptr": "*i64",
            "offs_ptr": "*i32",
            "num_local_experts": "i32",
            "inter": "i32",
        },
        {"BLOCK": 1024},
        4,
    ),
    ("moe_lab.moe.fused.kernels", "swiglu_backward_kernel"): (
        {
            "d_gate_up_ptr": "*bf16",
            "act_weighted_ptr": "*bf16",
            "d_row_weight_ptr": "*fp32",
            "gate_up_ptr": "*bf16",
            "d_act_weighted_ptr": "*bf16",
            "row_weight_ptr": "*fp32",
            "row_src_ptr": "*i64",
            "offs_ptr": "*i32",
            "num_local_experts": "i32",
        },
        {"INTER": 1536, "BLOCK": 1024},
        4,
    ),  # the 235B shape's expert width: two column blocks
    ("moe_lab.moe.fused.kernels", "zero_idle_experts_kernel"): (
        {"out_ptr": "*bf16", "offs_ptr": "*i32"},
        {"SLAB": 1536 * 4096, "PER_PROGRAM": 1536 * 4096 // 16, "BLOCK": 1024},
        4,
    ),
    ("moe_lab.moe.fused.kernels", "block_expert_counts_kernel"): (
        {"ids_ptr": "*i64", "counts_ptr": "*i64", "num_slots": "i32"},
        {"NUM_EXPERTS": 128, "E_POW2": 128, "BLOCK": 128},
        4,
    ),
    ("moe_lab.moe.fused.kernels", "slot_positions_kernel"): (
        {
            "ids_ptr": "*i64",
            "block_cum_ptr": "*i64",
            "block_counts_ptr": "*i64",
            "all_counts_ptr": "*i64",
            "pos_ptr": "*i64",
            "seg_end_ptr": "*i32",
            "num_slots": "i32",
            "my_rank": "i32",
            "align": "i32",
        },
        {"EP": 2, "NUM_EXPERTS": 128, "LOCAL": 64, "EP_POW2": 2, "E_POW2": 128, "BLOCK": 128},
        16,
    ),
    ("moe_lab.moe.fused.kernels", "row_experts_kernel"): (
        {"m_indices_ptr": "*i32", "offs_ptr": "*i32", "row_src_ptr": "*i64", "rows": "i32"},
        {"LOCAL": 64, "L_POW2": 64, "BLOCK": 128},
        4,
    ),
    # FP8 experts at the 235B shape (H 4096: 32 tiles a row; I 1536: 12), 8 rows a program
    ("moe_lab.moe.fp8.kernels", "quantize_rows_kernel"): (
        {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "num_rows": "i32"},
        {"TILES": 32, "ROWS": 8},
        4,
    ),
    ("moe_lab.moe.fp8.kernels", "dequantize_rows_kernel"): (
        {"q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "out_ptr": "*bf16", "num_rows": "i32"},
        {"TILES": 32, "ROWS": 8},
        4,
    ),
    ("moe_lab.moe.fp8.kernels", "swiglu_forward_fp8_kernel"): (
        {
            "act_ptr": "*fp8e4nv",
            "act_scale_ptr": "*fp32",
            "gate_up_ptr": "*bf16",
            "row_weight_ptr": "*fp32",
            "row_src_ptr": "*i64",
            "offs_ptr": "*i32",
            "num_local_experts": "i32",
        },
        {"TILES": 12, "ROWS": 8},
        4,
    ),
    ("moe_lab.moe.fp8.kernels", "swiglu_backward_fp8_kernel"): (
        {
            "d_gate_up_ptr": "*bf16",
            "d_gate_up_q_ptr": "*fp8e4nv",
            "d_gate_up_scale_ptr": "*fp32",
            "act_weighted_ptr": "*bf16",
            "d_row_weight_ptr": "*fp32",
            "gate_up_ptr": "*bf16",
            "d_act_weighted_ptr": "*bf16",
            "row_weight_ptr": "*fp32",
            "row_src_ptr": "*i64",
            "offs_ptr": "*i32",
            "num_local_experts": "i32",
        },
        {"TILES": 12, "ROWS": 8},
        4,
    ),
    ("moe_lab.moe.fp8.kernels", "weight_blocks_kernel"): (
        {"w_ptr": "*fp32", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "qt_ptr": "*fp8e4nv", "scale_t_ptr": "*fp32"},
        {"N": 3072, "K": 4096},
        4,
    ),
    ("moe_lab.runtime.host_read_kernel", "store_bytes_kernel"): (
        {"src_ptr": "*u8", "dst_address": "i64", "nbytes": "i64"},
        {"BLOCK": 1024},
        4,
    ),
}


@pytest.mark.parametrize("kernel", sorted(KERNELS), ids=lambda k: k[1])
def test_kernel_compiles_for_hopper_without_spills(kernel, tmp_path):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types, constants, num_warps = KERNELS[kernel]
    fn = getattr(importlib.import_module(kernel[0]), kernel[1])
    assert set(types) | set(constants) == set(fn.arg_names), "the table lists every argument of the kernel"
    source = ASTSource(
        fn=fn,
        signature={name: types.get(name, "constexpr") for name in fn.arg_names},
        constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()},
    )
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    (tmp_path / "kernel.ptx").write_text(ptx)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    done = subprocess.run(
        [ptxas, "-v", "--gpu-name", "sm_90a", str(tmp_path / "kernel.ptx"), "-o", str(tmp_path / "kernel.o")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "0 bytes spill stores" in done.stderr, done.stderr
