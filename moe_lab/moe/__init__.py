"""The MoE layer's pieces: router, experts (compute only), token dispatchers, their collectives and the fused op."""
