"""Run records (``record``) and sweep tables (``table``; ``moe_lab.results.load(sweep_dir)``)."""


def __getattr__(name: str):
    # pandas is imported only by whoever loads tables, not by every training process.
    if name == "load":
        from moe_lab.results.table import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
