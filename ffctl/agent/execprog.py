"""A worker given with `--no-python`: replace this process with the program named in argv.

Workers start as Python (a fork of the worker template, a warm spare or a fresh interpreter,
each running its argv as `__main__`); torchrun's `--no-python` runs the script as a program
instead. This module is that argv's `__main__`: it execs the program in place, so the worker's
pid, environment, log and parent (its agent) stay what the agent started.
"""
from __future__ import annotations

import os
import sys


def main(argv: list[str]) -> int:
    if not argv:
        print("ffctl: --no-python needs a program to run", file=sys.stderr)
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        print(f"ffctl: cannot run {argv[0]!r}: {exc.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: exec does not return


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
