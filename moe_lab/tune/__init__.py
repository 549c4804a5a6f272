"""``python -m moe_lab.tune``: which setting for this model on this cluster, planned over a search space and the best
few measured. ``space``: the axes (``conf/tune/``) and the points they span; ``planning``: every point planned and
ranked; ``measure``: the best measured as one ``moe_lab.train`` sweep; ``report``: the table, plot and winning line."""
