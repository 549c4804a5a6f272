"""Hydra finds this package under the ``hydra_plugins`` namespace and registers its config source."""
