"""Module ties run one way: the package's subpackages stand in one layer order, and a module imports only from its
own layer or below. Within the layers: no moe module imports moe.dispatcher (it sits on top of the router, experts,
collectives and fused op), and activation checkpointing (parallel.ac) knows no MoE module.

Checked statically over every import statement of the package (function-level and TYPE_CHECKING ones included), and
at run time for the bottom of the moe layer: importing it in a fresh interpreter loads none of the modules above it.
(Importing any module of moe_lab.parallel runs the package's __init__, which loads everything parallelize applies, so
the static check is the one that holds checkpointing to knowing no MoE module.)
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Bottom to top. A layer may import its own and every lower layer. runtime: leaf helpers (errors, device, host
# reads, paths); moe: router, experts, dispatchers; models: Qwen3-MoE, HF config and weights; parallel: mesh, FSDP2,
# EP, AC, compile; config validates by building the options of all of them (and reads checkpoint directories);
# plan and job use everything below; the entry points (report: the docs' tables, from records and plans) sit on top.
LAYERS = (
    ("runtime",),
    ("moe",),
    ("models",),
    ("parallel",),
    ("optim",),
    ("data",),
    ("metrics",),
    ("checkpoint",),
    ("config",),
    ("results",),
    ("plan",),
    ("job",),
    ("train", "export", "compare", "report", "tune"),
)
LAYER_OF = {name: depth for depth, names in enumerate(LAYERS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules its import statements name (``from a import b`` names a, and a.b when b is
    a module). A module's own enclosing packages are left out: Python runs them before the module in any case."""
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
        graph[name] = {m for m in named if m in modules and m != name and not name.startswith(m + ".")}
    return graph


def under(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def layer(module: str) -> int:
    """The layer of a module of the package (moe_lab.<name>...), by its first name under moe_lab."""
    name = module.split(".")[1]
    assert name in LAYER_OF, f"{module}: moe_lab.{name} has no place in LAYERS; put it where its imports say"
    return LAYER_OF[name]


def test_the_root_package_imports_nothing():
    assert import_graph()["moe_lab"] == set()


def test_every_module_imports_from_its_layer_or_below():
    graph = import_graph()
    upward = sorted(
        f"{module} (layer {layer(module)}) imports {target} (layer {layer(target)})"
        for module, imported in graph.items()
        if module != "moe_lab"
        for target in imported
        if layer(target) > layer(module)
    )
    assert not upward, "imports against the layer order:\n" + "\n".join(upward)


def test_an_upward_import_is_caught(monkeypatch):
    """The check above fails on one import upward: config importing the job layer."""
    graph = import_graph()
    assert layer("moe_lab.config.validate") < layer("moe_lab.job.trainer")
    assert not any(layer(t) > layer("moe_lab.config.validate") for t in graph["moe_lab.config.validate"])
    graph["moe_lab.config.validate"].add("moe_lab.job.trainer")
    monkeypatch.setattr(sys.modules[__name__], "import_graph", lambda: graph)
    with pytest.raises(AssertionError, match="moe_lab.config.validate .* imports moe_lab.job.trainer"):
        test_every_module_imports_from_its_layer_or_below()


def test_rules_within_the_layers():
    graph = import_graph()
    wrong = []
    for module, imported in graph.items():
        for target in imported:
            if (
                module != "moe_lab.moe.dispatcher"
                and under(module, "moe_lab.moe")
                and target == "moe_lab.moe.dispatcher"
            ):
                wrong.append((module, target))
            if module == "moe_lab.parallel.ac" and under(target, "moe_lab.moe", "moe_lab.models"):
                wrong.append((module, target))
    assert not wrong, f"imports against the layering: {sorted(wrong)}"
    assert {"moe_lab.moe.experts", "moe_lab.moe.router", "moe_lab.moe.dispatcher"} <= graph["moe_lab.models.qwen3_moe"]


def test_every_package_import_is_a_statement():
    """No module loads one of the package's modules by name at run time (importlib, __import__), so the graph above
    holds every tie between them: a backend registers itself where its op sees it, imported like any module."""
    by_name = []
    for path in (ROOT / "moe_lab").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = ast.unparse(node.func)
                if name.endswith(("import_module", "__import__")) and not (
                    node.args
                    and isinstance(node.args[0], ast.Constant)
                    and not node.args[0].value.startswith("moe_lab")
                ):
                    by_name.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not by_name, "modules loaded by name:\n" + "\n".join(by_name)


def test_no_import_cycles():
    graph = import_graph()
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
