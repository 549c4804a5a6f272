"""Qwen3-MoE (one readable file) and its Hugging Face checkpoint I/O; nothing here knows of process groups."""
