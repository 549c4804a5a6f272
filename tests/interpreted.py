"""A check of the Triton kernels run on CPU by Triton's interpreter: in a child process with ``TRITON_INTERPRET=1``
(set before triton is imported, and no other test sees interpreted kernels)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest


def interpreted(check: str, *args, timeout: int = 300):
    """``check(*args)`` (``"tests.module:function"``, args literals) in an interpreting child: what it returns, a
    literal (its repr read back)."""
    pytest.importorskip("triton")
    module, function = check.split(":")
    code = f"from {module} import {function} as f; print(repr(f(*{args!r})))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, TRITON_INTERPRET="1"),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])
