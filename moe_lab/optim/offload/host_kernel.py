"""offload=full's host step kernel (``host_kernel.c``): built at first use with the system C compiler, cached, loaded
with ctypes.

One call steps a whole flat master in one pass over memory on ``threads`` OpenMP threads, with the GIL released
(ctypes releases it around every foreign call): the training thread runs Python meanwhile, and the host step does not
wait for the GIL between blocks as a sequence of torch ops does.

The library is compiled with the C compiler named by ``CC`` (else ``cc``, else ``gcc``) into
``$XDG_CACHE_HOME/moe_lab/host_kernel/`` (``~/.cache`` without it), under a name hashed from the source, the flags,
the compiler's version and this CPU (``-march=native`` code runs only where it was built), written under a temporary
name and renamed, so that processes building it at once (ranks of one node) each load a whole file.

libgomp creates a calling thread's OpenMP threads at its first parallel region and they inherit that thread's CPU
affinity: offload=full's worker, bound to its GPU's NUMA node (``numa.py``) before it starts, keeps the kernel's
threads on that node.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("host_kernel.c")
# -ffp-contract=off: no multiply-add fused but the one torch's kernel writes (host_kernel.c); -fno-math-errno lets
# sqrtf vectorise (it changes no result).
FLAGS = ("-std=c99", "-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC")
TRANSFER_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or ("cc" if shutil.which("cc") else "gcc"))


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe_lab" / "host_kernel"


def _cpu_identity() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    return platform.machine() + "".join(
        next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags")
    )


def _compiler_version(compiler: list[str]) -> str:
    try:
        return subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise RuntimeError(
            f"offload=full builds its host step kernel ({SOURCE.name}) with the system C compiler at first use, and "
            f"the compiler {shlex.join(compiler)!r} (the CC environment variable, else cc, else gcc) cannot run: {e}"
        ) from None


def build_info() -> dict:
    """The compiler (its command and first line of ``--version``) and flags the kernel is built with, for records."""
    compiler = _compiler()
    return {
        "compiler": shlex.join(compiler),
        "version": _compiler_version(compiler).splitlines()[0],
        "flags": " ".join(FLAGS),
    }


def _build(compiler: list[str]) -> Path:
    source = SOURCE.read_bytes()
    version = _compiler_version(compiler)
    key = hashlib.sha256(
        b"\0".join(
            [
                source,
                " ".join(FLAGS).encode(),
                shlex.join(compiler).encode(),
                version.encode(),
                _cpu_identity().encode(),
            ]
        )
    )
    library = _cache_dir() / f"host_kernel-{key.hexdigest()[:20]}.so"
    if library.exists():
        return library
    try:
        library.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(suffix=".so", prefix=".host_kernel-", dir=library.parent)
    except OSError as e:
        raise RuntimeError(
            f"offload=full caches its host step kernel in {library.parent} (XDG_CACHE_HOME, else ~/.cache), which "
            f"cannot be written: {e}"
        ) from None
    os.close(fd)
    try:
        built = subprocess.run([*compiler, *FLAGS, str(SOURCE), "-o", temporary], capture_output=True, text=True)
        if built.returncode != 0:
            raise RuntimeError(
                f"offload=full: building its host step kernel failed ({shlex.join([*compiler, *FLAGS, str(SOURCE)])}):\n{built.stderr}"
            )
        os.replace(temporary, library)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return library


@functools.cache
def load() -> ctypes.CDLL:
    """The kernel's library, built first if this machine has none cached (offload=full calls it when it is built, so
    that a missing compiler fails before training starts)."""
    library = ctypes.CDLL(str(_build(_compiler())))
    f32, pointer, i64, threads = ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix in TRANSFER_SUFFIX.values():
        adamw = getattr(library, f"adamw_step_{suffix}")
        adamw.argtypes = [i64, pointer, pointer, pointer, pointer, f32, f32, f32, f32, f32, f32, f32, threads]
        adamw.restype = None
        signsgd = getattr(library, f"signsgd_step_{suffix}")
        signsgd.argtypes = [i64, pointer, pointer, f32, f32, threads]
        signsgd.restype = None
    return library


def _check(master: torch.Tensor, transfer: torch.Tensor, *state: torch.Tensor) -> str:
    for t in (master, *state):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.numel() != master.numel():
            raise ValueError("the host step kernel steps contiguous fp32 host tensors of one size")
    if transfer.dtype not in TRANSFER_SUFFIX or not transfer.is_contiguous() or transfer.numel() != master.numel():
        raise ValueError(
            f"the host step kernel's transfer buffer: contiguous, the master's size, {' or '.join(map(str, TRANSFER_SUFFIX))}"
        )
    return TRANSFER_SUFFIX[transfer.dtype]


def adamw_step(
    master: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    transfer: torch.Tensor,
    *,
    step: float,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    threads: int,
) -> None:
    """One AdamW step (``step``: the step count after it) of ``master`` and its moments, with the gradient in
    ``transfer``; the new weights go into ``transfer``. The scalars are torch's fused CPU kernel's, in double."""
    suffix = _check(master, transfer, exp_avg, exp_avg_sq)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    getattr(load(), f"adamw_step_{suffix}")(
        master.numel(),
        master.data_ptr(),
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        transfer.data_ptr(),
        1 - lr * weight_decay,
        1 - beta1,
        beta2,
        1 - beta2,
        math.sqrt(bias_correction2),
        eps,
        -(lr / bias_correction1),
        threads,
    )


def signsgd_step(master: torch.Tensor, transfer: torch.Tensor, *, lr: float, weight_decay: float, threads: int) -> None:
    """One SignSGD step of ``master`` with the gradient in ``transfer``; the new weights go into ``transfer``."""
    suffix = _check(master, transfer)
    getattr(load(), f"signsgd_step_{suffix}")(
        master.numel(), master.data_ptr(), transfer.data_ptr(), 1 - lr * weight_decay, -lr, threads
    )
