"""``python tests/in_turn.py JSON``: the ``python -m moe_lab.train`` command lines of a JSON list of argument lists,
run in turn in this one process, as a Hydra sweep runs its points (one Python start and one torch import for all of
them, where each takes seconds on a shared CPU). Each leaves its run directory as its own command would; one that
fails (its exit status is printed) does not stop the next. Tests start it with ``run_in_turn``."""

from __future__ import annotations

import json
import subprocess
import sys


def run_in_turn(commands: list[list[str]], cwd, timeout: float, env: dict | None = None) -> str:
    """Run ``commands`` in turn in one process of this script; -> the tail of its output, for assertion messages."""
    proc = subprocess.run(
        [sys.executable, __file__, json.dumps(commands)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.stdout[-3000:] + proc.stderr[-5000:]


def main(commands: list[list[str]]) -> None:
    from moe_lab import train

    for args in commands:
        sys.argv = ["moe_lab.train", *args]
        try:
            train.main()
        except SystemExit as e:
            if e.code not in (None, 0):
                print(f"in_turn: {args} exited {e.code}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
