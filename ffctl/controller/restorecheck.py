"""The check of a `--verify-restore` recovery, as the controller makes it from step reports.

Such a recovery restores an older step than it could (`ffctl.controller.decide`) and the ranks
train the steps up to the newest again; `Progress.check_replay` compares each rank's loss of each
with the rank's own before the fault. Here the outcome becomes the record's facts: a loss that
differs is a `restore_diverged` event, a line on the console and the reason the controller's
loop stops the job (`diverged`), before training goes on from state the restore did not bring
back; a generation whose every rank trained up to the newest step again is one
`restore_verified` event, saying whether every loss was compared and equal.
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ffctl.controller.cluster import Record
from ffctl.controller.progress import Replay
from ffctl.controller.state import JobState
from runs.events import EventKind


class RestoreCheck:
    def __init__(self, job: JobState, record: Record, announce: Callable[[str], None],
                 host: Callable[[int], str]) -> None:
        self.job = job
        self.record = record
        self.announce = announce
        self.host = host
        # (reason, root cause) once a replay differed: the controller's loop stops the job.
        self.diverged: tuple[str, dict[str, Any]] | None = None
        self._verified: set[int] = set()  # generations whose check is recorded

    def replayed(self, found: Replay) -> None:
        """A step trained again after a --verify-restore recovery: a loss unlike the rank's own
        before the fault stops the job (`diverged`, raised by the controller's loop); the
        generation's check is recorded once every rank has trained up to the newest step again."""
        progress, job = self.job.progress, self.job
        if found.compared and not found.matched and self.diverged is None:
            node = job.members.get(found.rank)
            error = (f"step {found.step}, trained again from the restored step {progress.restore_step}, gave loss "
                     f"{found.after!r}, not {found.before!r} as before the fault")
            summary = (f"rank {found.rank} (node {node}): {error}: the restore did not bring back some state the "
                       f"step uses (a prefetched batch, an RNG, a data position the script does not register)")
            self.record(EventKind.RESTORE_DIVERGED, gen=found.gen, step=found.step, rank=found.rank, node=node,
                        restore_step=progress.restore_step, loss_before=found.before, loss_after=found.after)
            self.announce(f"restore check FAILED: {summary}")
            cause = {"cause": "restore-diverged", "t": time.time(), "rank": found.rank, "node": node,
                     "host": self.host(node) if node is not None else "", "step": found.step,
                     "error": error, "summary": summary, "tail": []}
            self.diverged = (f"restore check failed: rank {found.rank}'s loss of step {found.step} differs "
                             f"after the restore", cause)
        if found.gen in self._verified:
            return
        verified = progress.replay_verified(set(job.members))
        if verified is None:
            return
        self._verified.add(found.gen)
        unchecked = sorted(r for r in job.members if not progress.replay_compared(r))
        self.record(EventKind.RESTORE_VERIFIED, gen=found.gen, restore_step=progress.restore_step,
                    until=progress.verify_until, verified=verified, unchecked=unchecked)
        if verified:
            self.announce(f"restore verified: steps {progress.restore_step + 1}-{progress.verify_until} trained again "
                          f"with every rank's loss as before the fault")
