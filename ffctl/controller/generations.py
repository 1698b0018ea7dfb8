"""The generation lifecycle: open generation g (publish its plan, spawn its ranks) and wait until
it runs (spawned, joined, restored), and the environment each rank is started with.

Generation 0 of a launch that resumes an earlier run (a requeued Slurm job) restores the newest
complete disk checkpoint the launch put in this record. What can interrupt a generation while it
starts is a failure becoming pending (RecoveryAbandoned, the coordinator starts over) or ranks
that never start (FatalRun).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ffctl.backends.protocol import NodeBackend
from ffctl.controller.cluster import FatalRun, Record, RecoveryAbandoned
from ffctl.controller.decide import Decision
from ffctl.controller.failures import Cause, Failure
from ffctl.controller.plane import ControlPlane
from ffctl.controller.state import JobState, Report
from ffctl.launch_spec import LaunchSpec
from recovery import disk
from wire import messages
from wire.jobenv import JobEnv, Strategy
from wire.generation_plan import Disk, GenerationPlan
from runs.events import EventKind, RestoreSource

PHASE_TIMEOUT = 120.0


class Generations:
    def __init__(self, spec: LaunchSpec, job: JobState, launcher: NodeBackend, plane: ControlPlane,
                 send: Callable[[int, messages.Message], None], wait_for: Callable[..., bool], record: Record,
                 run_id: str, record_dir: Path, plain_script: bool, max_restarts: int) -> None:
        self.spec = spec
        self.job = job
        self.launcher = launcher
        self.plane = plane
        self.send = send
        self.wait_for = wait_for
        self.record = record
        self.run_id = run_id
        self.record_dir = record_dir
        self.plain_script = plain_script
        self.max_restarts = max_restarts
        self._ahead: tuple[int, list[int]] = (-1, [])  # the opened generation, its ranks started before its plan

    def rank_env(self, rank: int, gen: int) -> dict[str, str]:
        spec = self.spec
        node = self.job.members[rank]
        local = sorted(r for r, n in self.job.members.items() if n == node)
        memory = spec.recovery in (Strategy.PEER, Strategy.RESTART_MEMORY)
        env = JobEnv(
            rank=rank, world_size=spec.world_size, local_rank=local.index(rank),
            local_world_size=len(local), node=node, run_id=self.run_id,
            store_host=spec.address, store_port=self.plane.port, gen=gen, strategy=spec.recovery,
            ckpt_dir=self.ckpt_dir(), ckpt_every=spec.ckpt_every, slots=spec.snapshot_slots,
            replicate=memory and spec.nnodes > 1, pg_timeout=spec.pg_timeout,
            role=spec.role, max_restarts=self.max_restarts,
            master_port=self.plane.rendezvous_port(gen) if self.plain_script else 0,
        )
        # No token: this travels through the store. The agent adds it where the rank starts.
        out = env.to_env()
        if dict(spec.torchrun).get("virtual_local_rank"):
            # torchrun's --virtual-local-rank: every worker is local rank 0 of the devices it sees.
            out["LOCAL_RANK"] = "0"
            if self.launcher.has_gpu():
                out["CUDA_VISIBLE_DEVICES"] = str(local.index(rank))
        return out

    def ckpt_dir(self) -> str:
        # Remote hosts keep checkpoints in their own run dir, not in our record.
        remote = self.launcher.run_dir
        return f"{remote}/checkpoints" if remote else str(self.record_dir / "checkpoints")

    def spawn(self, gen: int, ranks: list[int]) -> None:
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(self.job.members[r], []).append(r)
        for node, rs in by_node.items():
            for r in rs:
                self.job.spawning[r] = (gen, node)
            self.send(node, messages.Spawn(gen=gen, ranks=[{"rank": r, "env": self.rank_env(r, gen)} for r in rs]))

    def open(self, gen: int, decision: Decision | None, respawn: list[int],
             ahead: frozenset[int] = frozenset()) -> None:
        """Publish `gen`'s plan and spawn `respawn` into it, but for `ahead`: started already
        (`spawn` before the plan), they wait for it."""
        plan = decision.plan if decision else GenerationPlan.fresh(gen, self.spec.world_size, self.spec.recovery)
        self.job.gen = gen
        self.job.progress.open(gen, plan.restore_step, decision.verify_until if decision else 0)
        self.plane.publish(gen, plan)
        self._ahead = (gen, sorted(ahead & set(respawn)))
        self.spawn(gen, [r for r in respawn if r not in ahead])

    def await_running(self, gen: int, respawn: list[int], restore_step: int, source: RestoreSource) -> None:
        job = self.job
        world = set(job.members)
        # Spawned means started and ready to join (torch imported), not merely forked. A plain
        # script says nothing: its process being up is all there is.
        said = Report.SPAWNED if self.plain_script else Report.STARTED
        # (A rank that already ended cleanly without a word ran no library: it is done, see
        # Inbox._on_rank_exited, and nothing more is to be waited for from it.)
        # Not while its agent has yet to say it started one: a replacement started ahead and
        # stopped again (`coordinator.kept_ahead`) may have said `started` into this generation.
        spawned = lambda: set(respawn) <= (job.reported(said, gen) - set(job.spawning)) | job.reported(Report.DONE, gen)  # noqa: E731
        if not self.wait_for(spawned, PHASE_TIMEOUT, "spawn"):
            raise FatalRun(f"ranks {sorted(respawn)} were not spawned within {PHASE_TIMEOUT:g}s")
        # How each started (a warm spare, a fork of the template, a fresh interpreter) and how
        # long its agent took to start it.
        started = {str(r): job.started_by.get((gen, r), (None, None)) for r in respawn}
        self.record(EventKind.RANKS_SPAWNED, gen=gen, ranks=sorted(respawn),
                    pids={str(r): job.pids.get(r) for r in respawn},
                    started_by={r: how for r, (how, _) in started.items() if how},
                    start_s={r: s for r, (_, s) in started.items() if s is not None},
                    started_ahead=self._ahead[1] if self._ahead[0] == gen else [])
        if self.plain_script or world <= job.reported(Report.DONE, gen):
            job.last_progress = time.monotonic()
            return  # its rendezvous is torch's own (MASTER_ADDR), unseen here
        if not self.wait_for(lambda: world <= job.reported(Report.JOINED, gen), PHASE_TIMEOUT, "rendezvous"):
            job.fail(Failure(Cause.RENDEZVOUS_TIMEOUT, world - job.reported(Report.JOINED, gen)))
            raise RecoveryAbandoned("rendezvous")
        self.record(EventKind.RENDEZVOUS_DONE, gen=gen)
        if source not in (RestoreSource.NONE, RestoreSource.SCRIPT):  # step 0 too (GenerationPlan.restores)
            if not self.wait_for(lambda: world <= job.reported(Report.RESTORED, gen), PHASE_TIMEOUT, "restore"):
                job.fail(Failure(Cause.RESTORE_TIMEOUT))
                raise RecoveryAbandoned("restore")
            how = job.restore_how.get(gen, {})
            # Which ranks kept their live state, received it from one that did, or gathered it.
            # With the step's loss as the copies recorded it: the record keeps it should no
            # report of the step have come (every rank that trained it lost before reporting).
            self.record(EventKind.RESTORE_DONE, gen=gen, step=restore_step, source=source,
                        transfer={k: sorted(r for r, h in how.items() if h == k) for k in sorted(set(how.values()))},
                        loss=job.restore_loss.get(gen))
        job.last_progress = time.monotonic()

    def resumed(self) -> Decision | None:
        """Generation 0 of a launch that resumes an earlier run (a requeued Slurm job): the
        launch put that run's newest complete disk checkpoint in this record, and every rank
        restores it; None: a fresh start (a plain script restores itself, from its own files)."""
        steps = disk.complete_steps(self.record_dir / "checkpoints")
        if not steps or self.plain_script:
            return None
        self.job.disk_step = steps[-1]
        plan = GenerationPlan(gen=0, world_size=self.spec.world_size, strategy=Strategy(self.spec.recovery),
                              restore_step=steps[-1], sources={r: Disk() for r in sorted(self.job.members)})
        return Decision(plan, RestoreSource.DISK)
