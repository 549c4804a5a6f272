"""Training checkpoints: the whole training state through torch.distributed.checkpoint (``checkpointer``), their
directories on disk (``directory``). Hugging Face weights in and out of the model are ``moe_lab.models.hf_weights``."""

import warnings

# DCP warns on every call without a process group that it assumes one process: that is what is meant where it runs so.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
