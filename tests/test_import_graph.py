"""Module ties run one way (issue 14): models -> moe (router, experts, dispatcher); moe.dispatcher -> moe.experts,
moe.collectives, moe.fused; parallel -> moe, models; activation checkpointing knows no MoE module.

Checked statically over every import statement of the package (function-level and TYPE_CHECKING ones included), and
at run time for the bottom layer: importing it in a fresh interpreter loads none of the modules above it. (Importing
any module of moe_lab.parallel runs the package's __init__, which loads everything parallelize applies, so the
static check is the one that holds checkpointing to knowing no MoE module.)
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERED = ("moe_lab.moe", "moe_lab.models", "moe_lab.parallel")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules its import statements name (``from a import b`` names a, and a.b when b is
    a module)."""
    modules = {_module_name(p): p for p in (ROOT / "moe_lab").rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}: relative import"
                named |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = {m for m in named if m in modules and m != name}
    return graph


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_layers_import_one_way():
    graph = import_graph()
    wrong = []
    for module, imported in graph.items():
        for target in imported:
            if under(module, "moe_lab.moe") and under(target, "moe_lab.models", "moe_lab.parallel"):
                wrong.append((module, target))
            if under(module, "moe_lab.models") and under(target, "moe_lab.parallel"):
                wrong.append((module, target))
            if module != "moe_lab.moe.dispatcher" and under(module, "moe_lab.moe") and target == "moe_lab.moe.dispatcher":
                wrong.append((module, target))
            if module == "moe_lab.parallel.ac" and under(target, "moe_lab.moe", "moe_lab.models"):
                wrong.append((module, target))
    assert not wrong, f"imports against the layering: {sorted(wrong)}"
    assert {"moe_lab.moe.experts", "moe_lab.moe.router", "moe_lab.moe.dispatcher"} <= graph["moe_lab.models.qwen3_moe"]


def test_no_import_cycles():
    graph = {m: {t for t in ts if under(t, *LAYERED)} for m, ts in import_graph().items() if under(m, *LAYERED)}
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                pytest.fail("import cycle: " + " -> ".join(path[path.index(target) :] + [module, target]))
            if target not in state:
                visit(target, path + [module])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [])


@pytest.mark.parametrize(
    "module, must_not_load",
    [
        ("moe_lab.moe.experts", ("moe_lab.moe.dispatcher", "moe_lab.moe.router", "moe_lab.models")),
        ("moe_lab.moe.router", ("moe_lab.moe.dispatcher", "moe_lab.moe.experts", "moe_lab.models")),
    ],
)
def test_importing_loads_no_module_above(module, must_not_load):
    code = (
        f"import sys, {module}\n"
        f"print(sorted(m for m in sys.modules if any(m == p or m.startswith(p + '.') for p in {must_not_load!r})))"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]", f"importing {module} loaded {done.stdout.strip()}"
