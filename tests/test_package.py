"""moe_lab installs anywhere: the wheel carries the config tree and the studies' presets (the default job runs, and
a preset composes, from a directory outside the source), and an editable install still imports from the clone's
parent directory, where the clone itself (a folder named moe_lab) would otherwise be imported as a namespace package.

Each test installs into a fresh venv that also sees this interpreter's packages (torch, hydra and the rest come
from the environment running the tests, a venv or not; moe_lab is installed with --no-deps) and runs with PYTHONPATH
unset, so the worktree's code is not what gets imported.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.sweep import ROOT

pytestmark = pytest.mark.slow  # builds a wheel and venvs, runs jobs from them

# What a source distribution holds: the package, its build settings, the config tree, the studies' presets.
SOURCE = ["pyproject.toml", "README.md", "moe_lab", "conf", "experiments", "hydra_plugins"]
IGNORE = shutil.ignore_patterns("__pycache__", "*.egg-info", "records")


def copy_source(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in SOURCE:
        src = ROOT / name
        if src.is_dir() and not src.is_symlink():
            shutil.copytree(src, dest / name, ignore=IGNORE, symlinks=True)
        elif src.exists() or src.is_symlink():
            shutil.copy(src, dest / name, follow_symlinks=False)
    return dest


def run(cmd: list, cwd: Path, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def site_dirs() -> list[str]:
    """Where this interpreter's packages are: its site directories (a venv's own, when the tests run in one) and the
    user's, if Python reads it."""
    user = [site.getusersitepackages()] if site.ENABLE_USER_SITE else []
    return [d for d in site.getsitepackages() + user if Path(d).is_dir()]


def venv(path: Path) -> Path:
    """A venv that sees this interpreter's packages (pip included), after its own; returns its python.

    Not ``--system-site-packages``: run from a venv, that shows the base interpreter's packages, not the venv's. A
    ``.pth`` line in the new venv adds this interpreter's site directories as site directories (their own ``.pth``
    files processed), behind the venv's own, so what is installed into the venv comes first."""
    run([sys.executable, "-m", "venv", "--without-pip", path], cwd=path.parent)
    python = path / "bin" / "python"
    purelib = Path(
        run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], cwd=path.parent).stdout.strip()
    )
    (purelib / "_outer_site.pth").write_text("".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs()))
    return python


def test_wheel_runs_the_default_job_from_another_directory(tmp_path):
    source = copy_source(tmp_path / "src")
    run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            tmp_path / "dist",
            source,
        ],
        cwd=tmp_path,
    )
    (wheel,) = (tmp_path / "dist").glob("moe_lab-*.whl")
    studies = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("moe_lab/experiments/")]
    assert "moe_lab/experiments/grid_30b/preset.yaml" in studies and all(n.endswith(".yaml") for n in studies)
    python = venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "-q", "--no-deps", wheel], cwd=tmp_path)
    shutil.rmtree(source)  # nothing may come from the source tree

    work = tmp_path / "work"
    work.mkdir()
    where = run([python, "-c", "import moe_lab; print(moe_lab.__file__)"], cwd=work).stdout
    assert str(tmp_path / "venv") in where
    run([python, "-m", "moe_lab.train", "trainer.steps=2", "hydra.run.dir=run"], cwd=work)
    assert json.loads((work / "run" / "result.json").read_text())["status"] == "ok"
    job = run([python, "-m", "moe_lab.train", "+experiment=grid_30b/seq8192", "--cfg", "job"], cwd=work).stdout
    assert "name: qwen3_30b" in job and "seq_len: 8192" in job  # a study variant over the study over the shared preset


def test_editable_install_imports_from_the_clones_parent_directory(tmp_path):
    clone = copy_source(tmp_path / "moe_lab")  # a clone keeps the project's name
    python = venv(tmp_path / "venv")
    run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "-e", clone], cwd=tmp_path)
    proc = run(
        [python, "-c", "import moe_lab; from moe_lab.results import load; print(moe_lab.__file__)"], cwd=tmp_path
    )
    assert proc.stdout.strip() == str(clone / "moe_lab" / "__init__.py")
    job = run([python, "-m", "moe_lab.train", "+experiment=routing_skew", "--cfg", "job"], cwd=tmp_path).stdout
    assert "routing: skewed" in job
