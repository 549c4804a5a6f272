"""Files a run leaves for others to read."""

from __future__ import annotations

import os
from pathlib import Path


def give_plain_file_mode(path: str | Path) -> None:
    """Give ``path`` the mode a plain ``open(path, "w")`` would (0666 less the umask). Writers that go through a
    private file first (``tempfile.mkstemp``, safetensors' ``save_file``) leave it owner-only (0600), unreadable to
    the group that shares a run or model directory."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
