"""``python tests/in_turn.py JSON``: the ``python -m moe_lab.train`` command lines of a JSON list of argument lists,
run in turn in this one process, as a Hydra sweep runs its points (one Python start and one torch import for all of
them, where each takes seconds on a shared CPU). Each leaves its run directory as its own command would; one that
fails (its exit status is printed) does not stop the next."""

from __future__ import annotations

import json
import sys

from moe_lab import train


def main(commands: list[list[str]]) -> None:
    for args in commands:
        sys.argv = ["moe_lab.train", *args]
        try:
            train.main()
        except SystemExit as e:
            if e.code not in (None, 0):
                print(f"in_turn: {args} exited {e.code}", flush=True)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
