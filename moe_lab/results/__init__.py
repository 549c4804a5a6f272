"""Run records (``record``), sweep tables (``table``; ``moe_lab.results.load(sweep_dir)``) and tunes (``tune``;
``moe_lab.results.load_tune(tune_dir)``: every point a ``python -m moe_lab.tune`` planned, its measured beside)."""


def __getattr__(name: str):
    # pandas is imported only by whoever loads tables, not by every training process.
    if name == "load":
        from moe_lab.results.table import load

        return load
    if name == "load_tune":
        from moe_lab.results.tune import load_tune

        return load_tune
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
