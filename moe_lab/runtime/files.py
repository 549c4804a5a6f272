"""Files a run leaves for others to read."""

from __future__ import annotations

import os
from pathlib import Path


def give_plain_file_mode(path: str | Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would (0666 less the umask). Writers that go through a
    private file first (``tempfile.mkstemp``, safetensors' ``save_file``) leave it owner-only (0600), unreadable to
    the group that shares a run or model directory."""
    os.chmod(path, 0o666 & ~current_umask())


def current_umask() -> int:
    """The process's umask, read from /proc where Linux shows it: reading it with ``os.umask`` means setting it for
    a moment, and a file another thread (an async checkpoint's writer) creates in that moment gets mode 0666."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    umask = os.umask(0)  # no /proc (macOS): the brief swap
    os.umask(umask)
    return umask
