"""torch.compile per decoder block (after activation checkpointing, before FSDP, as in torchtitan)."""


def apply_compile(model) -> None:
    for layer in model.model.layers:
        layer.compile()
