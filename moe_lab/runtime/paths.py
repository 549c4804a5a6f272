"""Where the Hydra config tree is: the one place that says so.

In a checkout the tree is the top-level ``conf/`` and ``moe_lab/conf`` links to it; a wheel carries the tree as
``moe_lab/conf`` itself (the build follows the link). Either way it is found beside this package.
"""

from __future__ import annotations

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
# The studies' presets, found the same way: moe_lab/experiments links to the checkout's experiments/.
EXPERIMENTS_DIR = Path(__file__).resolve().parents[1] / "experiments"
