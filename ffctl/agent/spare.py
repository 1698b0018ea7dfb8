"""A worker process, warm or cold: `python -m ffctl.agent.spare`.

It imports torch and the recovery library first, then waits on stdin for its assignment (one
JSON line: environment, argv, log path) and runs the training script in-process. A spare forked
from the agent's template (ffctl.agent.template) is warm from birth and reads its assignment from
a FIFO the agent made for it instead. The agent keeps a few of these ready (`--spares`) so a
replacement skips interpreter and torch start-up; a cold start is the same process assigned at
once. It dies with its agent (PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import json
import os
import sys

from ffctl.agent.template import SPARE_FIFO_ENV, Assignment, die_with_parent, run_as_main, warm_up


def main() -> int:
    fifo = os.environ.pop(SPARE_FIFO_ENV, None)
    if fifo is None:
        die_with_parent()
        warm_up()
        # Tell the agent this spare is warm; stdout is a pipe to the agent until assignment.
        os.write(1, b"ready\n")
        line = sys.stdin.readline()
    else:
        # Forked from the agent's template: warm already, adopted by the agent and bound to it.
        # The assignment comes through the agent's FIFO (the template's pipes are not ours).
        try:
            with open(fifo, "rb") as fh:
                line = fh.readline().decode()
        except OSError:
            return 0
    if not line:
        return 0  # released unassigned
    job = Assignment.from_json(json.loads(line))
    os.environ.update(job.env)
    return run_as_main(Assignment(dict(os.environ), job.argv, job.log, job.cwd, job.token, job.err))


if __name__ == "__main__":
    sys.exit(main())
