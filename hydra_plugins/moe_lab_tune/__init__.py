"""Hydra finds this package under the ``hydra_plugins`` namespace: the sweeper ``moe_lab.tune`` measures with."""
