"""`Job`: the recovery API a training script links (DESIGN.md, "One-step restoration").

    job = Job.from_env()
    job.register_stateful("model", model, replicated=True)   # anything with state_dict/load_state_dict
    job.register("optim", opt.state_dict, opt.load_state_dict, replicated=True)  # or the two callables
    job.run(step_fn, steps)          # step_fn(ctx) -> loss; uses ctx.allreduce(tensor)

Per step the library commits, snapshots into the agent's shared memory (the copy overlaps the
next step and is fenced before the next collective, so before the next optimizer update), and
reports the step once its snapshot is durable. When a peer fails, the collective is aborted, the
rank waits for the next generation's plan, rebuilds its process group and restores the plan's
step (`recovery.restore`): from its own slot, the local agent, the ring neighbour or disk. A
survivor caught in the first collective of the step after the restored one goes on with that
step, repeating only the collective (`Job._collective`); any other rank trains it again.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import random
import sys
import threading
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist

from recovery import ddp, disk, failed_step, fsdp, process_group, termination

from wire import control, messages
from recovery.context import StepContext
from recovery.errors import PeerFailure, RecoveryError, StepRestart
from recovery.faults import InStepFaults
from recovery.group import Generation, SeenHook
from wire.jobenv import JobEnv, Strategy
from recovery.peer import ChannelError, PeerClient
from wire.generation_plan import Disk, Fresh, GenerationPlan, LocalSlot, PeerReplica, Source
from recovery.slots import SlotContent, SlotWriter, read_slot, slot_path
from recovery.restore import KEPT, Prepared, Unusable, agree, prepare, restore
from recovery.snapshot import Capture, StateEntry, capture, replicated, state_entry
from runs.events import RestoreHow, StepPhase

if TYPE_CHECKING:
    from recovery.standalone import PlainJob

T = TypeVar("T")
CONTINUED = RestoreHow.CONTINUED  # a survivor kept its state and goes on with the step it was in
# How long a rank waits for the next generation's plan: the controller publishes one within
# about 90 s of a failure at most (abort 5 s, inventory 10 s, an agent restarted 60 s, teardown
# 15 s). Past twice that the rank gives up and exits with the reason, a failure the controller
# sees, rather than wait on a plan a stranger may be keeping from it.
PLAN_TIMEOUT = 180.0
# A join (rendezvous, agreement, restore) that takes longer than this is stuck somewhere: the
# rank writes every thread's Python stack to its error log, once, so a recovery that runs into
# the controller's phase timeout (120 s) leaves the place where each rank waited.
JOIN_STALL_S = 60.0
ACK_TIMEOUT = 2.0
# Between looks at the header while waiting for the ring neighbour's copy. The agent's answer
# (`Ringer.wait`) ends a wait at once; this bounds one whose answer was lost.
ACK_POLL_S = 0.005
ERROR_TRACE_LINES = 20


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


@contextlib.contextmanager
def _stall_dump() -> Iterator[None]:
    """Have every thread's stack written to the rank's error log if the block (waiting for a
    plan, joining, restoring) outlasts JOIN_STALL_S. Nothing where stderr is no file."""
    err, armed = sys.__stderr__, False
    if err is not None:
        try:
            faulthandler.dump_traceback_later(JOIN_STALL_S, repeat=False, file=err)
            armed = True
        except (ValueError, OSError, AttributeError):  # a stderr with no file descriptor
            pass
    try:
        yield
    finally:
        if armed:
            faulthandler.cancel_dump_traceback_later()


class Job:
    def __init__(self, env: JobEnv) -> None:
        self.env = env
        self.entries: list[StateEntry] = [StateEntry("rng", _rng_state, _set_rng_state, replicated=False)]
        self.store = control.connect(env.store_host, env.store_port, timeout=60.0)
        if not env.token:
            raise RuntimeError("FFCTL_TOKEN is not set: a rank gets the job token from its agent")
        # Every message to the controller is sealed; plans and abort flags are opened before use.
        self._sealer = control.Sealer(env.token, f"rank/{env.rank}")
        self._opener = control.Opener(env.token)
        # One for the rank's life: the generation pointer it reads never goes back, and a forged
        # value is reported once, however many recoveries see it.
        self._plans = control.Reader(self._opener, self._rejected)
        self._send_lock = threading.Lock()  # step reports also go out from the snapshot thread
        self.group: Generation | None = None
        self.writer = (SlotWriter(env.shm_dir, env.run_id, env.node, env.rank, env.token, env.slots)
                       if env.memory_snapshots else None)
        self.faults = InStepFaults(env.fault_dir, env.run_id, env.rank)
        self.last_committed = 0
        self._skipped = 0  # the matrix products the last step skipped, having failed (`failed_step`)
        self.stopped_at: int | None = None  # the step `run(until=...)` ended the job after
        self._step = 0  # the step being trained
        self._collectives = 0  # collectives the step has started so far
        self._waited = 0.0  # seconds the step spent in collectives (reported: the straggler signal)
        self._retry_input: torch.Tensor | None = None
        self._ack_degraded = False
        # Hooks (`on_after_step`, `on_fresh_start`; `register_ddp` adds its own through them).
        self._after_step: list[Callable[[float], float]] = []
        self._on_fresh_start: list[Callable[[Generation], None]] = []
        self.api = "step-function"  # how the script trains, told to the controller (`register_ddp`: "ddp")
        self._reduction: ddp.Reduction | None = None  # `use_reduction`, by `register_ddp`
        # SIGTERM (the agent's stop, a term-rank fault) unwinds so the slots are fenced and
        # closed, and ends the process within a bound whatever the main thread is doing.
        termination.install()
        self._send(messages.Started, gen=env.gen, pid=os.getpid())

    @classmethod
    def from_env(cls) -> Job | PlainJob:
        """The job of this rank. Outside ffctl (plain torchrun, or `python SCRIPT`) the same
        surface over torch's default process group, recovering nothing
        (`recovery.standalone.PlainJob`), so an adapted script still runs there."""
        from recovery.standalone import PlainJob, under_ffctl

        if not under_ffctl():
            return PlainJob.from_env()
        return cls(JobEnv.from_env())

    # -- registration -------------------------------------------------------------------------
    def register(self, name: str, state_dict: Callable[[], Any] | None = None,
                 load_state_dict: Callable[[Any], None] | None = None, *, replicated: bool = False,
                 sharded: bool = False, replicas: tuple[int, ...] = (), **aliases: Callable[..., Any]) -> None:
        """Hand the library a piece of state as two callables, named as torch names them: one
        that returns the state (`state_dict`), one that puts a returned state back
        (`load_state_dict`). The older keywords `get=` and `set=` still work. `replicated=True`
        for state that is the same on every rank (data-parallel parameters, a replicated
        optimizer): it is snapshotted once per replica group, each rank keeping a 1/W slice.
        `sharded=True` for large state that is each rank's own (an FSDP model's and optimizer's
        shards, `DTensor`s included): kept whole by the rank, as bytes, never pickled; with
        `replicas` (the global ranks holding the same shards, HSDP's replica group) a lost rank's
        shards are healed from a live holder."""
        if any(e.name == name for e in self.entries):
            raise ValueError(f"state {name!r} registered twice")
        self.entries.append(state_entry(name, state_dict, load_state_dict, replicated, aliases, sharded, replicas))

    def register_stateful(self, name: str, obj: Any, *, replicated: bool = False) -> None:
        """Hand the library an object with torch's `state_dict()` and `load_state_dict(state)`
        (a module, an optimizer, a scheduler: torch's `Stateful`), as `dcp.save` takes them."""
        self.register(name, obj.state_dict, obj.load_state_dict, replicated=replicated)

    # -- hooks: what `register_ddp` (recovery/ddp.py) builds on, public and documented -----------
    @property
    def world_size(self) -> int:
        """The number of ranks of the generation this rank is in (the job's, before the first
        is joined). ffctl keeps it constant across generations; read it here, not from the
        environment, so code that divides by it follows the group it reduces over."""
        return self.group.world_size if self.group is not None else self.env.world_size

    def on_after_step(self, hook: Callable[[float], float]) -> None:
        """Run `hook(loss)` after each step function, in the order added; it returns the loss to
        report (the DDP path makes it the mean over the ranks) and may raise `PeerFailure` to
        unwind a step that must not commit (one whose gradient reduction failed)."""
        self._after_step.append(hook)

    def on_fresh_start(self, hook: Callable[[Generation], None]) -> None:
        """Run `hook(group)` on every rank when the job starts from step 0, once the first
        generation's group is up and before the first step (DDP's broadcast of rank 0's
        parameters, which its constructor did not do over a private group)."""
        self._on_fresh_start.append(hook)

    def use_reduction(self, reduction: ddp.Reduction) -> None:
        """The DDP gradient reduction this job's steps go through (`register_ddp` makes it):
        the job reports itself as a DDP job, and `StepContext.reduce_loss` hands it the loss."""
        if self._reduction is not None:
            raise RuntimeError("register_ddp was called twice")
        self._reduction = reduction
        self.api = "ddp"

    @property
    def reduction(self) -> ddp.Reduction | None:
        """The DDP reduction `register_ddp` registered, or None (a step-function job)."""
        return self._reduction

    # -- torch DDP (recovery/ddp.py) ----------------------------------------------------------
    def ddp_group(self) -> Any:
        """The process group to build `DistributedDataParallel` with: this rank's alone, so DDP
        itself never waits on a peer; its gradients travel over the job's generations instead."""
        return ddp.private_group()

    def register_ddp(self, *, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any | None = None,
                     loader: Any | None = None) -> Any:
        """Hand over a DDP training's state as objects: `model` (a `DistributedDataParallel`
        built with `process_group=job.ddp_group()`), its optimizer, LR scheduler and `DataLoader`.
        Returns an endless iterator over the loader's batches whose position is restored with the
        rest (None without a loader). Call before the first forward."""
        self._phase_hooks(model.module, optimizer)
        return ddp.attach(self, model, optimizer, scheduler, loader)

    def _phase_hooks(self, module: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> None:
        """Where a kill-rank with phase=backward or phase=optimizer lands: the backward pass
        (the module's last parameter gets its gradient, about the first backward computes) and
        the optimizer's update."""
        params = [p for p in module.parameters() if p.requires_grad] if module is not None else []
        if params:
            params[-1].register_post_accumulate_grad_hook(lambda _: self.faults.at(StepPhase.BACKWARD, self._step))
        optimizer.register_step_pre_hook(lambda *_: self.faults.at(StepPhase.OPTIMIZER, self._step))

    # -- torch FSDP2 / HSDP (recovery/fsdp.py) -------------------------------------------------
    def device_mesh(self, device_type: str, mesh_shape: tuple[int, ...], *,
                    mesh_dim_names: tuple[str, ...] | None = None) -> Any:
        """torch's `init_device_mesh(device_type, mesh_shape, mesh_dim_names=...)`, its process
        groups ffctl's (`recovery.process_group`): build `fully_shard` on this mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        process_group.init_default_group(self.env.rank, self.env.world_size)
        return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names)

    def register_fsdp(self, *, model: Any, optimizer: torch.optim.Optimizer, scheduler: Any | None = None,
                      loader: Any | None = None) -> Any:
        """Hand over an FSDP2 training's state as objects: `model` (sharded with `fully_shard` on
        `job.device_mesh(...)`), its optimizer, LR scheduler and `DataLoader`. Returns an
        endless iterator over the loader's batches whose position is restored with the rest
        (None without a loader). Call before the first forward."""
        self.api = "fsdp"
        self._phase_hooks(None, optimizer)  # FSDP's backward: its first collective (phase=collective)
        return fsdp.attach(self, model, optimizer, scheduler, loader)

    # -- collectives --------------------------------------------------------------------------
    def allreduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks of the current generation, in place. Fences the previous
        step's snapshot first: the optimizer update that follows must not race the copy."""
        def run() -> torch.Tensor:
            self.fence()
            return self._group().allreduce(tensor)

        return self._collective(run, tensor)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape on all ranks), in rank order."""
        return self._collective(lambda: self._group().allgather(tensor), None)

    def _group(self) -> Generation:
        assert self.group is not None
        return self.group

    def _collective(self, run: Callable[[], T], inplace: torch.Tensor | None) -> T:
        """Run a collective of the current step (`_collective_once`), counting the time it
        blocks: a rank's busy time is its step time less that, what the straggler detector reads."""
        self.faults.at(StepPhase.COLLECTIVE, self._step)
        begun = time.perf_counter()
        try:
            return self._collective_once(run, inplace)
        finally:
            self._waited += time.perf_counter() - begun

    def _collective_once(self, run: Callable[[], T], inplace: torch.Tensor | None) -> T:
        """When a peer fails during the step's first collective, a survivor has changed nothing
        yet: once the next generation is joined and restored to the previous step, a survivor
        whose live state is that step's (checked by the restore, like any "kept" rank) takes up
        the step where it stopped and repeats only the collective, with its input as it was,
        rather than computing the step again. Its state at this point, RNG and non-tensor values
        included, is what a fault-free run has here. Any other case unwinds the step
        (`StepRestart`), to run again from the start."""
        first = self._collectives == 0
        self._collectives += 1
        if not first or self.env.strategy != Strategy.PEER:
            return run()
        saved: torch.Tensor | None = None
        if inplace is not None:  # the collective writes partial results into its input
            saved = self._retry_input
            if saved is None or saved.shape != inplace.shape or saved.dtype != inplace.dtype:
                saved = self._retry_input = torch.empty_like(inplace)
            saved.copy_(inplace)
        while True:
            try:
                return run()
            except PeerFailure as exc:
                step, how = self._recover(exc, in_step=True)
                if how != CONTINUED:
                    raise StepRestart(exc.gen, step) from None
                if inplace is not None and saved is not None:
                    inplace.copy_(saved)  # the aborted attempt left partial sums in it

    def fence(self) -> None:
        """Wait until the previous step's snapshot is durable (copied, and held by the ring
        neighbour when there is one) and reported."""
        if self.writer is not None:
            self.writer.fence()

    def _snapshot(self, cap: Capture, report: Callable[[], None] | None = None) -> None:
        assert self.writer is not None

        def durable() -> None:
            try:
                if self.env.replicate:
                    self._wait_replicated(cap.step)
            finally:
                # The controller hears of the step once it can be restored, so a fault fired
                # "at step k" finds step k in memory rather than racing its copy. A failure cut
                # short the wait for the neighbour's copy: the step is still committed here and
                # the recovery may restore it, so its loss must reach the run record anyway.
                if report is not None:
                    report()

        self.writer.begin(cap, then=durable)

    def _wait_replicated(self, step: int) -> None:
        # On the snapshot thread. The ring neighbour must hold step k before this rank takes
        # part in step k+1's collective (the fence waits for this thread); then a node loss
        # never costs more than one step. If the neighbour is gone, stop waiting (the controller
        # will fall back) and wait again once it has caught up.
        assert self.writer is not None
        deadline = time.monotonic() + (0.2 if self._ack_degraded else ACK_TIMEOUT)
        while self.writer.replicated_step(step) < step:
            if self.group is not None and self.group.watcher.aborted.is_set():
                raise PeerFailure(self.group.gen, "aborted while waiting for the neighbour's copy")
            if time.monotonic() > deadline:
                self._ack_degraded = True
                return
            self.writer.wait_ack(ACK_POLL_S)
        self._ack_degraded = False

    def _settle_snapshot(self) -> None:
        """Let an in-flight snapshot finish after a peer failure; it may have seen the abort."""
        if self.writer is not None:
            try:
                self.writer.fence()
            except PeerFailure:
                pass

    # -- the loop ----------------------------------------------------------------------------
    def run(self, step_fn: Callable[[StepContext], float], steps: int,
            until: Callable[[int, float], bool] | None = None) -> None:
        """Train steps up to `steps`, recovering from peers' failures. `until(step, loss)`, when
        given, is asked after each step with the loss the run records (on the DDP path the mean
        over the ranks): true ends the job after that step, on every rank at the same step (the
        answers are agreed on in one small allreduce per step, part of the step)."""
        self.faults.install()
        self.faults.on_land = self._fault_landed
        process_group.on_collective(lambda: self.faults.at(StepPhase.COLLECTIVE, self._step))
        self._send(messages.Training, gen=self.env.gen, api=self.api)
        if self.env.gen > 0 and self.env.strategy == Strategy.PEER:
            # A replacement's first look at its live state is its costliest: torch's sharded
            # optimizer state dict creates the optimizer's state with a step of zeros, and each
            # DTensor op's sharding is worked out the first time (0.1 s for the medium GPT on a
            # CPU). Taken now it costs nothing when the replacement was started ahead of the plan
            # (while the survivors leave their step); the restore's look reuses it.
            replicated(self.entries, self.env.world_size)
        try:
            try:
                with _stall_dump():
                    gen, plan = control.newest_plan(self.store, self.env.gen, PLAN_TIMEOUT, self._opener,
                                                    self._rejected, reader=self._plans)
                    start, _ = self._join(gen, plan)
            except PeerFailure as exc:
                start, _ = self._recover(exc)
            while True:
                try:
                    self._train(step_fn, start, steps, until)
                    self.fence()  # the last step's report goes before "done"
                    break
                except StepRestart as exc:
                    start = exc.step  # the new generation is joined and its step restored already
                except PeerFailure as exc:
                    start, _ = self._recover(exc)
            assert self.group is not None
            self._send(messages.Done, gen=self.group.gen, step=self.last_committed)
        finally:
            process_group.bind(None)
            if self.group is not None:
                self.group.close()
            if self.writer is not None:
                self.writer.close()
            # Training is over: a SIGTERM from now on (the agent stopping a rank still tearing
            # down) ends the process as usual instead of raising inside interpreter shutdown.
            termination.release()
            code = termination.terminated()
            if code is not None:
                # Unwound by a SIGTERM with the slots closed: leave now, as torchrun's worker
                # would have at the signal, not after the interpreter's teardown.
                termination.exit_now(code)

    def _recover(self, exc: PeerFailure, in_step: bool = False) -> tuple[int, RestoreHow | None]:
        """Leave the failed generation, then join the newest one and restore its step, again as
        long as faults interrupt that. Returns the restored step and how this rank got its state
        (`recovery.restore`, or CONTINUED: see `_collective`, which passes `in_step`)."""
        if self.env.strategy != Strategy.PEER:
            # Restart strategies tear every rank down; exit and let the agent respawn.
            raise RecoveryError(str(exc)) from None
        while True:
            try:
                with _stall_dump():
                    self._settle_snapshot()
                    self._send(messages.Aborted, gen=exc.gen, step=self.last_committed, reason=exc.reason,
                               skipped=self._skipped)
                    self._skipped = 0  # (a failure while joining the next generation skipped nothing)
                    gen, plan = control.newest_plan(self.store, exc.gen + 1, PLAN_TIMEOUT, self._opener,
                                                    self._rejected, reader=self._plans)
                    return self._join(gen, plan, in_step)
            except PeerFailure as again:
                exc = again

    def _send(self, kind: type[messages.Message], **fields: Any) -> None:
        """Report a message of `kind` (every one from a rank names the rank and its node)."""
        msg = kind(rank=self.env.rank, node=self.env.node, **fields)  # type: ignore[call-arg]  # a kind a rank sends
        with self._send_lock:
            blocked = control.send(self.store, control.CTL_QUEUE, msg, self._sealer)
        if blocked is not None:
            self._not_sent(msg, blocked)

    def _not_sent(self, msg: messages.Message, blocked: control.Blocked) -> None:
        # The controller's queue counter was tampered with and not repaired: nobody reads the
        # queue now, so the rank's log is the only place left to say so.
        print(f"ffctl rank {self.env.rank}: {msg.kind.value} not sent: {blocked.reason}", file=sys.stderr, flush=True)

    def _abort_seen(self, gen: int) -> SeenHook:
        msg = messages.AbortSeen(rank=self.env.rank, node=self.env.node, gen=gen)

        def seen(store: dist.Store) -> None:
            if self.writer is not None:
                self.writer.wake()  # a snapshot thread waiting for the neighbour's copy sees the abort now
            # The sealer's lock keeps this sender's sequence numbers in queue order across threads.
            blocked = control.send(store, control.CTL_QUEUE, msg, self._sealer)
            if blocked is not None:
                self._not_sent(msg, blocked)
        return seen

    def _rejected(self, where: str, index: int, reason: str, raw: bytes) -> None:
        """A forged plan, generation pointer or abort flag: ignored, and the controller told."""
        try:
            self._send(messages.Refusal, where=where, index=index, reason=reason, raw=control.short_repr(raw))
        except Exception:  # the controller is gone: nobody to tell
            pass

    def _join(self, gen: int, plan: GenerationPlan, in_step: bool = False) -> tuple[int, RestoreHow | None]:
        """Join generation `gen` and restore its plan's step (none: a fresh start). Returns the
        step and how this rank got its state (None for a fresh start)."""
        if self.group is not None:
            self.group.close()  # destroyed on a thread of its own, once no collective is blocked
        step, world, restores = plan.restore_step, plan.world_size, plan.restores
        source = plan.source(self.env.rank)
        prepared: list[Prepared] = []

        def fetch_and_check() -> None:
            # Reading this rank's copy and the checksums of its live state need no group: done
            # while the group is built, they cost the recovery nothing when others are slower.
            local = isinstance(source, LocalSlot) and source.node == self.env.node
            prepared.append(prepare(self.entries, self._fetch(step, source), step, world, local))

        self.group = Generation(self.store, self.env.store_host, self.env.store_port, gen, self.env.rank,
                                world, self.env.pg_timeout, self.env.backend,
                                meanwhile=fetch_and_check if restores else None, opener=self._opener,
                                on_forged=lambda key, reason, raw: self._rejected(key, -1, reason, raw),
                                on_seen=self._abort_seen(gen))
        process_group.bind(self.group)  # torch's own modules' collectives run on it from now on
        how: RestoreHow | None = None
        restored_loss: float | None = None
        if not restores:
            self.group.barrier()
            for start in self._on_fresh_start:
                start(self.group)
            self._send(messages.Joined, gen=gen)
        else:
            # The exchange of what each rank holds is the group's first collective: it serves as
            # the barrier too, which saves a round through every rank of the ring.
            table = agree(self.group, prepared[0])
            self._send(messages.Joined, gen=gen)
            # Only a survivor stopped in the step right after the restore step may go on with it.
            keep_live = in_step and step == self._step - 1
            how = self._restore(gen, step, source, prepared[0], table, keep_live)
            how = CONTINUED if keep_live and how == KEPT else how
            # The loss the copy recorded for the step: every rank that trained it may have been
            # lost after its copy was held off-node and before its report went out, and the
            # step is not trained again.
            meta = prepared[0].meta or {}
            restored_loss = meta.get("loss") if isinstance(meta.get("loss"), float) else None
            self._send(messages.Restored, gen=gen, step=step, source=source.kind, how=how, loss=restored_loss)
        self.last_committed = step
        if self.writer is not None and how not in (KEPT, CONTINUED):  # (a fresh start's `how` is None)
            # The initial state is a step too: a rank lost in step 1 is restored from step 0
            # rather than leaving no common step at all. So is a state received from disk or a
            # peer, which this rank's slots do not hold: a rank lost before the next step is then
            # restored from memory, not (a chaos soak's faults come seconds apart) the whole job
            # from disk again.
            self._snapshot(capture(self.entries, step, self.env.rank, self.group.world_size, loss=restored_loss))
        return step, how

    def _fetch(self, step: int, source: Source) -> SlotContent | None:
        """This rank's copy of `step` from its plan's source (None: not there, or unreachable;
        the restore then finds it unusable and the controller decides again without it)."""
        if isinstance(source, Disk):
            return disk.load(self.env.ckpt_dir, step, self.env.rank)
        if isinstance(source, PeerReplica):
            try:
                client = PeerClient(source.address, source.port, self.env.token)
                try:
                    return client.get(self.env.rank, step, source.where.value)
                finally:
                    client.close()
            except ChannelError:
                return None
        if isinstance(source, LocalSlot):
            return read_slot(slot_path(self.env.shm_dir, self.env.run_id, source.node, self.env.rank, step % self.env.slots))
        assert isinstance(source, Fresh), source  # the plan's decoder admits no other kind
        return None

    def _restore(self, gen: int, step: int, source: Source, prepared: Prepared,
                 table: list[list[int]], keep_live: bool) -> RestoreHow:
        assert self.group is not None
        try:
            return restore(self.group, self.entries, prepared, table, keep_live)
        except Unusable as exc:
            why = "missing" if prepared.content is None else "checksum mismatch"
            if exc.mine:
                holder = source.holder if isinstance(source, PeerReplica) else None
                self._send(messages.RestoreFailed, gen=gen, step=step, source=source.kind, reason=why, holder=holder)
            raise PeerFailure(gen, f"state for step {step} unusable on some rank ({why if exc.mine else 'peer'})") from None

    def _train(self, step_fn: Callable[[StepContext], float], start: int, steps: int,
               until: Callable[[int, float], bool] | None = None) -> None:
        if until is not None and self.stopped_at is not None and start >= self.stopped_at:
            return  # restored to the step it had already decided to stop after
        for step in range(start + 1, steps + 1):
            self._step, self._collectives, self._waited = step, 0, 0.0
            process_group.take_waited()
            t0 = time.perf_counter()
            try:
                self.faults.check()
                self.faults.at(StepPhase.FORWARD, step)
                try:
                    loss = float(step_fn(StepContext(step, self)))
                finally:
                    # A failed step's products were skipped; the next one's run. Told in `aborted`.
                    self._skipped = failed_step.leave()
                failed = process_group.failure()
                if failed is not None:
                    raise failed  # a collective of torch's modules failed: the step is not committed
                for after in self._after_step:
                    loss = after(loss)
                stop = until is not None and self._agree(until(step, loss))
            except PeerFailure:
                raise
            except Exception as exc:
                failed = process_group.failure()
                if failed is not None:
                    # The step raised after a collective of torch's modules failed on a lost peer
                    # (the optimizer's pre-hook, or code that tripped on the garbage): a peer
                    # failure, not an error of the script.
                    raise failed from None
                self._report_error(step, exc)
                raise
            self._commit(step, loss, t0)
            if stop:
                self.stopped_at = step
                return

    def _agree(self, stop: bool) -> bool:
        """Whether any rank wants to stop after this step (every rank gets the same answer)."""
        flag = torch.tensor([1.0 if stop else 0.0])
        self.allreduce(flag)
        return bool(flag.item() > 0)

    def _report_error(self, step: int, exc: Exception) -> None:
        """Tell the controller that the step raised (a device error, an OOM, a bug), with the
        error's first line: it learns at once, not when this process has finished unwinding."""
        lines = str(exc).strip().splitlines()
        text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        # The traceback's last lines, for the root cause the controller prints if the job stops.
        trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
        try:
            self._send(messages.StepError, gen=self.group.gen if self.group else self.env.gen, step=step, error=text[:500],
                       traceback=[line[:400] for line in trace[-ERROR_TRACE_LINES:]])
        except Exception:  # the controller may be gone; the exit still tells the agent
            pass

    def _fault_landed(self, phase: StepPhase, step: int) -> None:
        self._send(messages.FaultLanded, gen=self.group.gen if self.group else self.env.gen, step=step, phase=phase.value)

    def _commit(self, step: int, loss: float, t0: float) -> None:
        """Commit `step` (begun at `t0`): capture its snapshot and report it once durable. The
        step's time includes the capture, so what per-step snapshots cost a step shows in it;
        a periodic disk checkpoint is written after that, outside it."""
        self.faults.at(StepPhase.SNAPSHOT, step)
        self.last_committed = step
        self._waited += process_group.take_waited()  # FSDP's own collectives, on ffctl's groups
        gen = self.group.gen if self.group else 0
        needs_disk = self.env.ckpt_every > 0 and step % self.env.ckpt_every == 0 and self.env.ckpt_dir
        if self.writer is None and not needs_disk:
            self._send(messages.Step, gen=gen, step=step, loss=loss, dt=time.perf_counter() - t0, wait=self._waited)
            return
        cap = capture(self.entries, step, self.env.rank, self.group.world_size if self.group else self.env.world_size,
                      loss=loss)
        dt, waited = time.perf_counter() - t0, self._waited
        report = lambda: self._send(messages.Step, gen=gen, step=step, loss=loss, dt=dt, wait=waited)  # noqa: E731
        if self.writer is not None:
            self._snapshot(cap, report)
        else:
            report()
        if needs_disk:
            disk.save(self.env.ckpt_dir, cap)
            self._send(messages.Ckpt, step=step, gen=gen, loss=loss, dt=dt)
