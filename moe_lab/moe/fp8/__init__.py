"""Blockwise FP8 (e4m3) for the routed experts, DeepSeek-V3's recipe: activations and gradients in 1x128 tiles along
the GEMM's contraction dimension, weights in 128x128 blocks, one fp32 scale per tile or block (``quant``: the plain
PyTorch reference; ``kernels``: the Triton kernels; ``weights``: the per-step weight cache)."""
