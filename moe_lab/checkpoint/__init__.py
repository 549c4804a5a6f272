"""Training checkpoints: the whole training state through torch.distributed.checkpoint (``checkpointer``), their
directories on disk (``directory``). Hugging Face weights in and out of the model are ``moe_lab.models.checkpoint``."""
