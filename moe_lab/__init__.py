"""moe_lab: Hydra-composed Mixture-of-Experts parallelism experiments on Qwen3-MoE."""
