"""Pure metrics: a run's events in, its recovery figures out (docs/guides/reports.md).

Definitions, all on the controller clock:
- detection_s = detected - injected.
- recovery_s = resumed - injected; `resumed` is when the job completes step m+1, m being the
  highest step any rank had completed when the fault hit. Replay of rolled-back steps is included.
- breakdown: detect, decide, spawn, rendezvous, restore, replay; they add up to recovery_s.
- lost_steps = m - s, s being the step the job was restored to. An unchanged script (a "plain
  script") restores itself: s is the step before the first one it reports again, and None with
  restore_source "none" when it started over from its first step; lost_steps is None (unknown)
  when the script reported no step before or after the fault.
- lost_s = the wall time the job lost to the fault against its own pace before it (`_lost_windows`):
  from the last commit before the injection until the job is back at that pace after the fault
  ended, that window's length less the time the steps it gained would have taken at that pace.
  It covers what recovery_s cannot see: a hang shorter than the detection threshold, a slowdown.
- lost_gpu_hours = world_size x lost_s / 3600.
Per run, lost_gpu_hours_total is the sum over the faults: time covered by two faults' windows is
split between them, so nothing is billed twice.

A failure the controller detected that no injected fault explains is a fault too, of kind
`detected` (`_detected_faults`): every figure above, measured from the failure's onset (the time
its record gives, `measured_from` says which) where an injected fault's are measured from its
injection.

A plain script's run reports strategy `torchrun-restart` (its group is stopped and started again
whatever --recovery asked, `none` aside) and a goodput only when it reports steps.

Status: a `run_finished` event's, else `running` while the controller lives and `incomplete`
once it is gone (`run_status`). Whether it lives is not in the events: the caller that can look
(runs.store.controller_alive) passes it in, so everything here stays a function of its inputs.
Figures of an incomplete run stop at the controller's last event.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any, Callable, Iterable, TypeVar

from runs import report_fields as rf
from runs.events import Event, EventKind, RestoreSource, RunStatus, finish_reason

BREAKDOWN_KEYS = ("detect", "decide", "spawn", "rendezvous", "restore", "replay")
# "Back at pace" after a fault ended: the first commit from which BACK_WINDOW consecutive step
# intervals have a median within PACE_TOLERANCE of the pre-fault pace, the first interval too (a
# median alone would wave a slow first interval through unbilled).
BACK_WINDOW = 3
PACE_TOLERANCE = 0.2
# The strategy of an unchanged script's run: torchrun's restart of the whole group, whatever
# --recovery asked (the controller runs restart-memory in place of peer, and the script restores
# itself from its own checkpoint); `--recovery none` still stops it at the first failure.
SCRIPT_RESTART = "torchrun-restart"


def run_strategy(requested: str, plain_script: bool) -> str:
    """The strategy a run really carries out: `requested` (--recovery), or for a plain script
    SCRIPT_RESTART (`none` stays `none`)."""
    if plain_script and requested != "none":
        return SCRIPT_RESTART
    return requested


@dataclass(frozen=True)
class FaultMetrics:
    fault_id: str
    kind: str
    target: str
    emulated: bool
    injected_at: float
    detected_at: float | None
    resumed_at: float | None
    detection_s: float | None
    recovery_s: float | None
    breakdown: dict[str, float | None]
    at_step: int
    restore_step: int | None
    lost_steps: int | None  # None: unknown (a plain script that reported no step around the fault)
    restore_source: str | None
    lost_gpu_hours: float
    recovered: bool
    # The fault's end, when it was reverted: by the controller, or by the dead man's switch on
    # the target host (the controller was gone, or its revert failed). revert_ok is False when a
    # revert command failed.
    reverted_at: float | None = None
    reverted_by: str | None = None
    revert_ok: bool | None = None
    # How each replacement of the recovery started (spare | template | cold), by rank.
    started_by: dict[str, str] = field(default_factory=dict)
    # The replacements started before the recovery's decision, while the survivors left their step.
    started_ahead: list[int] = field(default_factory=list)
    # The survivors that left their failed step without computing its matrix products.
    survivors_without_products: int = 0
    # Wall time lost to the fault against the job's pace before it (see `_lost_windows`); the
    # pace (seconds per step) it was measured against, and when the job was back at it (None:
    # it never was before the run ended, and the loss counts to the end).
    lost_s: float = 0.0
    pace_s: float | None = None
    back_at_pace_at: float | None = None
    # False for an unchanged script that reports no steps (neither `recovery.report_step` nor
    # `--step-regex`): its step at the fault is unknown, and its recovery ends when every
    # restarted worker is up again (`recovery_until` "workers-up") rather than at step m+1
    # ("step"); lost_s is then that restart time, a lower bound (its replay is unseen).
    step_known: bool = True
    recovery_until: str = "step"
    # --verify-restore: "verified", "diverged" or "unchecked" (`_restore_check`); None: not checked.
    restore_check: str | None = None
    # Where a kill-rank with phase= landed, as the rank said: {"step": S, "phase": P}; where a
    # corrupt-snapshot copy=replica did, as the holders said: {"replicas": {"<node>": [steps]}}.
    landed: dict[str, Any] | None = None
    # What `injected_at` is: "injection" for a fault ffctl injected; for a failure no injected
    # fault explains (kind DETECTED) the onset its record gives ("reported", "agent-exit",
    # "last-heartbeat", "last-progress"; "detection" in a record that predates onsets).
    measured_from: str = "injection"
    # How the job noticed it: the `failure_detected` event's cause, "straggler" for a slowdown
    # the straggler detector named (None: never detected).
    cause: str | None = None
    # The slow ranks the straggler detector named for this fault (`_stragglers`), one each:
    # rank, factor, onset_step, onset_t, detected_at, detected_after_steps, last_step, end_t,
    # steps, lost_s (the time the others waited for it, from the ranks' busy times).
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    # Copies the recovery read and refused before the one it restored (a corrupt snapshot, a
    # copy gone missing): what each was and why, in the order they were refused.
    rejected_copies: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RunMetrics:
    run_id: str
    status: str
    strategy: str
    world_size: int
    steps_completed: int
    final_loss: float | None
    loss_by_step: list[list[Any]]  # [int step, float loss or None], as JSON lists
    faults: list[FaultMetrics] = field(default_factory=list)
    lost_gpu_hours_total: float = 0.0
    spare_gpu_hours: float = 0.0
    goodput: float | None = None
    wall_s: float | None = None
    reason: str = ""  # why the run ended as it did (the controller's words; "controller lost")
    # Messages refused as forged, replayed or malformed, by the controller or reported by an
    # agent or rank (those recorded one by one and those only counted under a flood).
    messages_rejected: int = 0
    # False for a plain script that reported no steps: steps_completed is then unknown, not 0.
    step_known: bool = True
    # Seconds during which some rank's state had no copy on another node (`protection_lost` to
    # `protection_restored`, or to the end): a loss of its node then would have lost it.
    unprotected_s: float = 0.0
    # Faults asked for that never took effect (`fault_missed`): fault_id, kind, target, trigger, reason.
    missed_faults: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        # loss_by_step pairs are [int step, float loss]; keep the step an int in JSON.
        out["loss_by_step"] = [[int(s), loss] for s, loss in self.loss_by_step]
        return out


def _text(value: Any) -> str:
    """A field as plain text: a `str` enum gives its value (`str()` of one gives `Class.MEMBER`)."""
    return str(value.value) if isinstance(value, Enum) else str(value)


def _gen_at(inj: Event, events: list[Event]) -> int:
    """The generation running when `inj` was written: its own `gen`, else the newest one named
    by an earlier event (a fault after a recovery hits the new generation, not generation 0)."""
    if inj.get("gen") is not None:
        return rf.gen(inj)
    gen = 0
    for ev in events:
        if ev is inj:
            break
        if ev.get("gen") is not None:
            gen = max(gen, rf.gen(ev))
    return gen


def _landed(events: list[Event], ti: float, ranks: list[Any], kind: Any) -> dict[str, Any] | None:
    """Where the fault of `kind` injected at `ti` on `ranks` landed: a phase kill's step and
    phase, or the replicas each holder corrupted (up to the next injection of its kind, which
    may land there too)."""
    landings = []
    for ev in events:
        if ev.t < ti:
            continue
        if ev.kind is EventKind.FAULT_INJECTED and ev.t > ti and ev.get("kind") == kind:
            break  # the next fault of its kind: what lands from here on is that one's
        if ev.kind is EventKind.FAULT_LANDED and ev.get("rank") in ranks:
            landings.append(ev)
    if kind == "corrupt-snapshot":
        replicas = {str(rf.key(ev, "node")): rf.counts(ev, "steps") for ev in landings if ev.get("where") == "replica"}
        return {"replicas": replicas} if replicas else None
    kill = next((ev for ev in landings if ev.get("where") != "replica"), None)
    return {"step": rf.opt_count(kill, "step"), "phase": rf.opt_text(kill, "phase")} if kill is not None else None


def _first(events: Iterable[Event], pred: Any) -> Event | None:
    for ev in events:
        if pred(ev):
            return ev
    return None


V = TypeVar("V")


def _final_values(events: list[Event], value: Callable[[Event], V],
                  restored: Callable[[Event], V | None] | None = None) -> dict[int, V]:
    """Each step's `value` as the job finally committed it. A decision to restore step s sets
    steps past s aside (they will be recomputed) and brings back steps up to s that an earlier,
    abandoned decision had set aside: restoring s means s and everything before it stand. A
    script that restores itself (restore_source "script") went back to the step before the first
    one it reports again: that first report is where its decision takes effect. `restored`: the
    value a `restore_done` gives its step when no report of that step was recorded (every rank
    that trained it was lost between its copy being held and its report going out)."""
    values: dict[int, V] = {}
    aside: dict[int, V] = {}
    script_gen: int | None = None  # a script's restart whose restore step is not known yet
    floor = -1  # steps up to this one were trained by the run this launch resumed

    def restore(s: int) -> None:
        for step in [k for k in values if k > s]:
            aside[step] = values.pop(step)
        for step in [k for k in aside if k <= s]:
            values[step] = aside.pop(step)

    for ev in events:
        if ev.kind is EventKind.STEP:
            step = rf.step(ev)
            if script_gen is not None and rf.gen(ev) >= script_gen:
                script_gen = None
                restore(step - 1)
            values[step] = value(ev)
            aside.pop(step, None)
        elif ev.kind is EventKind.RECOVERY_DECIDED and ev.get("restore_step") is not None:
            script_gen = None
            restore(rf.count(ev, "restore_step"))
        elif ev.kind is EventKind.RECOVERY_DECIDED and rf.text(ev, "restore_source") == "script":
            script_gen = rf.gen(ev)
        elif ev.kind is EventKind.RESTORE_DONE and restored is not None and rf.opt_count(ev, "step") is not None:
            step = rf.step(ev)
            if rf.gen(ev) == 0:
                # A launch that resumed an earlier run's checkpoint: that run trained the steps
                # up to it, this one's record starts after them.
                floor = max(floor, step)
                continue
            got = restored(ev)
            if step > floor and step not in values and got is not None:
                values[step] = got
    return values


def _is_step(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _field(name: str) -> Callable[[Event], float | None]:
    def get(ev: Event) -> float | None:
        # Absent: 0.0 (a record before losses were reported); null: a step without a loss. A
        # NaN or infinity is a loss the job really had (it diverged).
        if name in ev.data and ev.data[name] is None:
            return None
        return rf.number(ev, name, 0.0, finite=False)
    return get


def final_losses(events: list[Event]) -> dict[int, float | None]:
    """Loss of every step as the job finally committed it (None: a step reported without one)."""
    return _final_values(events, _field("loss"), restored=_restored_loss)


def _restored_loss(ev: Event) -> float | None:
    # Tolerated, unlike a step's loss: a restore's loss is what its copies held, and garbage
    # there only means the step's loss is unknown (the step itself stands).
    loss = ev.get("loss")
    return float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None


def _final_step_times(events: list[Event], plain_script: bool = False) -> dict[int, float]:
    if not plain_script:
        return _final_values(events, lambda ev: rf.duration(ev, "step_time_s"))
    # A plain script's step time is the time between its reports (or printed lines): the first
    # one of each generation spans the start-up (a step printed) or nothing (`report_step` counts
    # from its first call), so it is taken at the median of the others.
    firsts: set[int] = set()
    seen: set[int] = set()
    for ev in events:
        if ev.kind is EventKind.STEP:
            gen = rf.gen(ev)
            if gen not in seen:
                seen.add(gen)
                firsts.add(id(ev))
    others = [rf.duration(ev, "step_time_s") for ev in events
              if ev.kind is EventKind.STEP and id(ev) not in firsts]
    typical = statistics.median(others) if others else 0.0
    return _final_values(events, lambda ev: typical if id(ev) in firsts else rf.duration(ev, "step_time_s"))


def _fault_metrics(inj: Event, events: list[Event], world_size: int, end_t: float,
                   mentions: Callable[[Event], bool] | None = None) -> FaultMetrics:
    """One fault's figures. `inj` is its `fault_injected` event (or, for a failure no injected
    fault explains, one `_detected_faults` made up); `mentions` picks the events that name it
    (by default those whose `fault_ids` hold its id)."""
    fid = rf.ident(inj, "fault_id")
    ti = inj.t
    if mentions is None:
        mentions = lambda ev: fid in _ids(ev.get("fault_ids"))  # noqa: E731
    detected = _first(events, lambda ev: ev.kind is EventKind.FAILURE_DETECTED and mentions(ev))
    slow = _stragglers(events, mentions)
    # A slowdown is detected when the straggler detector names a slow rank, unless a failure
    # (a replaced straggler) was detected first.
    noticed_t = detected.t if detected else (min(x["detected_at"] for x in slow) if slow else None)
    # A recovery that refused the copy it was given (restore-failed) decides again, under a
    # failure of its own that the fault explains: the fault's recovery is that whole chain, and
    # its last decision is what was restored.
    chain = [ev for ev in events if ev.kind is EventKind.FAILURE_DETECTED
             and (mentions(ev) or fid in _ids(ev.get("explained_by")))]
    failure_ids = {rf.ident(ev, "failure_id") for ev in chain if ev.get("failure_id") is not None}
    decisions = [ev for ev in events if ev.kind is EventKind.RECOVERY_DECIDED
                 and (mentions(ev) or failure_ids & set(_ids(ev.get("failure_ids"))))]
    rejected = [rf.text(ev, "detail", "None") for ev in chain if ev.get("cause") == "restore-failed"]
    gen_at_fault = _gen_at(inj, events)
    decision = decisions[-1] if decisions else None
    # m: the highest step completed when the fault hit. Steps the old generation still finished
    # after injection count too: they were done before the job noticed (a rank killed right
    # after a collective lets its peers commit that step, and their reports may arrive after
    # the detection). The old generation can commit nothing once the recovery is decided.
    first_decision = decisions[0] if decisions else None
    hit_t = first_decision.t if first_decision else (end_t if detected else ti)
    m = rf.count(inj, "at_step")
    # A plain script's group is stopped whole once its restart is decided: a step of its
    # generation recorded after that is a line it printed before, read late (not a rank of a
    # generation going on), so it counts whenever it arrived.
    whole = decision is not None and rf.text(decision, "restore_source") == RestoreSource.SCRIPT.value
    for ev in events:
        if ev.kind is EventKind.STEP and (whole or ev.t <= hit_t) and rf.gen(ev) == gen_at_fault:
            m = max(m, rf.step(ev))
    step_known = any(ev.kind is EventKind.STEP for ev in events)
    restore_step = rf.opt_count(decision, "restore_step") if decision is not None else None
    restore_source = rf.opt_text(decision, "restore_source") if decision is not None else None
    lost_steps: int | None = max(0, m - restore_step) if restore_step is not None else 0
    if decision is not None and _healed_all(events, decision):
        restore_source = RestoreSource.REPLICA_GROUP.value
    if decision is not None and not step_known:
        # A script that says nothing of its steps: recovered once every restarted worker is up;
        # what it trains again is its own business, unknown here (not 0).
        gen = rf.gen(decision)
        if restore_source == RestoreSource.SCRIPT.value:
            lost_steps = None
        resumed = _first(events, lambda ev: ev.kind is EventKind.RANKS_SPAWNED and rf.gen(ev) == gen
                         and ev.t >= decision.t)
    elif decision is not None:
        gen = rf.gen(decision)
        resumed = _first(
            events,
            lambda ev: ev.kind is EventKind.STEP
            and ev.t >= decision.t
            and rf.gen(ev) >= gen
            and rf.step(ev) >= m + 1,
        )
        if restore_source == "script":
            restore_step, restore_source, lost_steps = _script_restore(events, decision, m)
    elif inj.get("cause") == STRAGGLER:
        # A straggler no injected fault explains is over when the detector saw it back at pace.
        ends = [float(x["end_t"]) for x in slow if x.get("end_t") is not None]
        resumed = Event(EventKind.STEP, max(ends), {}) if ends and len(ends) == len(slow) else None
    elif detected is not None or inj.get("breaks_job"):
        # The job noticed and nothing recovered it (yet), or a kill it has not noticed yet: the
        # steps committed meanwhile were in flight when it hit (a node's loss takes a heartbeat
        # timeout to see), and only a recovery brings the job back.
        resumed = None
    else:
        resumed = _first(
            events, lambda ev: ev.kind is EventKind.STEP and ev.t > ti and rf.step(ev) >= m + 1
        )
    failed = _first(events, lambda ev: ev.kind is EventKind.RECOVERY_FAILED and mentions(ev))
    if failed is not None and (resumed is None or failed.t < resumed.t):
        resumed = None
    breakdown: dict[str, float | None] = {k: None for k in BREAKDOWN_KEYS}
    if detected is not None:
        breakdown["detect"] = detected.t - ti
    if decision is not None and detected is not None:
        gen = rf.gen(decision)
        phase = lambda kind: _first(  # noqa: E731
            events, lambda ev: ev.kind is kind and rf.gen(ev) == gen and ev.t >= decision.t
        )
        marks = [detected.t, decision.t]
        for kind in (EventKind.RANKS_SPAWNED, EventKind.RENDEZVOUS_DONE, EventKind.RESTORE_DONE):
            done = phase(kind)
            # A phase the strategy skips (no restore under `none`) takes no time.
            marks.append(done.t if done is not None else marks[-1])
        if resumed is not None:
            marks.append(resumed.t)
        for key, (a, b) in zip(BREAKDOWN_KEYS[1:], zip(marks, marks[1:])):
            breakdown[key] = max(0.0, b - a)
    recovery_s = resumed.t - ti if resumed is not None else None
    reverted_at, reverted_by, revert_ok = _revert_of(fid, events)
    spawned = None
    if decision is not None:
        spawned = _first(events, lambda ev: ev.kind is EventKind.RANKS_SPAWNED
                         and rf.gen(ev) == rf.gen(decision) and ev.t >= decision.t)
    started_by = spawned.get("started_by") if spawned is not None else None
    ahead = spawned.get("started_ahead") if spawned is not None else None
    ranks = inj.get("ranks") if isinstance(inj.get("ranks"), list) else []
    # An older record has none: 0.
    unwound = rf.count(decision, "survivors_without_products") if decision is not None else 0
    return FaultMetrics(
        restore_check=_restore_check(events, decision),
        landed=_landed(events, ti, ranks, inj.get("kind")),
        fault_id=fid,
        kind=rf.text(inj, "kind", "None"),
        target=_hit(rf.text(inj, "target", "None"), inj),
        emulated=bool(inj.get("emulated", False)),
        injected_at=ti,
        detected_at=noticed_t,
        resumed_at=resumed.t if resumed else None,
        detection_s=(noticed_t - ti) if noticed_t is not None else None,
        recovery_s=recovery_s,
        breakdown=breakdown,
        at_step=m,
        restore_step=restore_step,
        lost_steps=lost_steps,
        restore_source=restore_source,
        lost_gpu_hours=0.0,  # from lost_s, once every fault's window is known (`compute`)
        recovered=resumed is not None,
        reverted_at=reverted_at,
        reverted_by=reverted_by,
        revert_ok=revert_ok,
        started_by={str(r): str(h) for r, h in started_by.items()} if isinstance(started_by, dict) else {},
        started_ahead=sorted(r for r in ahead if type(r) is int) if isinstance(ahead, list) else [],
        survivors_without_products=unwound,
        step_known=step_known,
        recovery_until="step" if step_known else "workers-up",
        measured_from=rf.text(inj, "measured_from") or "injection",
        cause=rf.opt_text(detected, "cause") if detected is not None and detected.get("cause") is not None
        else (STRAGGLER if slow else None),
        stragglers=slow,
        rejected_copies=rejected,
    )


def _restore_check(events: list[Event], decision: Event | None) -> str | None:
    """How a --verify-restore recovery's replay came out: "verified" (every rank's loss of every
    step trained again as before the fault), "diverged" (one differed: the job stopped),
    "unchecked" (a rank had no earlier loss to compare, or the check never ended); None: not
    checked (no --verify-restore, or nothing to replay)."""
    if decision is None:
        return None
    gen = rf.gen(decision)
    if any(ev.kind is EventKind.RESTORE_DIVERGED and rf.gen(ev) == gen for ev in events):
        return "diverged"
    # (A disk restore, or a fresh start, trains reported steps again too: checked the same way.)
    done = _first(events, lambda ev: ev.kind is EventKind.RESTORE_VERIFIED and rf.gen(ev) == gen)
    if done is not None:
        return "verified" if done.get("verified") is True else "unchecked"
    return "unchecked" if decision.get("verify_until") else None


def _stragglers(events: list[Event], mentions: Callable[[Event], bool]) -> list[dict[str, Any]]:
    """What the straggler detector said of the slow ranks these events name: per detection, its
    end (the first `straggler_ended` of that rank after it) when there is one."""
    out = []
    for det in events:
        if det.kind is not EventKind.STRAGGLER_DETECTED or not mentions(det):
            continue
        rank = rf.opt_count(det, "rank")
        onset = rf.opt_count(det, "onset_step")
        end = _first(events, lambda ev: ev.kind is EventKind.STRAGGLER_ENDED and rf.opt_count(ev, "rank") == rank
                     and ev.t >= det.t and rf.opt_count(ev, "onset_step") == onset)
        src = end if end is not None else det
        step = rf.opt_count(det, "step")
        out.append({
            "rank": rank, "factor": rf.number(src, "factor", None), "onset_step": onset,
            "onset_t": rf.number(det, "onset_t", None), "detected_at": det.t, "step": step,
            "detected_after_steps": step - onset + 1 if step is not None and onset is not None else None,
            "last_step": rf.opt_count(end, "last_step") if end else None,
            "end_t": rf.number(end, "end_t", None) if end else None,
            "steps": rf.opt_count(end, "steps") if end else None,
            "lost_s": rf.number(end, "lost_s", None, minimum=0.0) if end else None,
        })
    return out


# The kind of a fault ffctl did not inject: a failure the controller detected and no injected
# fault explains (a rank that crashed or was killed from outside, an agent stopped, a store attack).
DETECTED = "detected"
# The cause of a detected fault that is a slowdown the straggler detector named.
STRAGGLER = "straggler"


def _ids(value: Any) -> list[str]:
    """A list of ids from a record field; anything else holds none."""
    return [str(v) for v in value] if isinstance(value, list) else []


def _onset(ev: Event) -> tuple[float, str]:
    """(when a `failure_detected` began, what that time is): its `onset_t` when the record has a
    usable one (a number no later than the detection), else the detection itself."""
    onset = ev.get("onset_t")
    if isinstance(onset, (int, float)) and not isinstance(onset, bool) and math.isfinite(onset) \
            and float(onset) <= ev.t:
        return float(onset), rf.text(ev, "onset") or "reported"
    return ev.t, "detection"


def _in_effect(events: list[Event], end_t: float) -> list[tuple[float, float]]:
    """When each injected fault with a duration was in force: from its injection to its revert
    (without one, until its duration ran out, or the run's end). A fault that could not be
    applied never was (a failed revert leaves it in force: its switch reverts it later)."""
    never = {rf.ident(ev, "fault_id") for ev in events if ev.kind is EventKind.FAULT_FAILED
             and not rf.text(ev, "error").startswith("revert")}
    spans = []
    for ev in events:
        fid = rf.ident(ev, "fault_id")
        duration = ev.get("duration")
        if ev.kind is not EventKind.FAULT_INJECTED or duration is None or fid in never:
            continue
        reverted_at, _, _ = _revert_of(fid, events)
        if reverted_at is None:
            ok = isinstance(duration, (int, float)) and not isinstance(duration, bool) and math.isfinite(duration)
            reverted_at = min(end_t, ev.t + float(duration)) if ok else end_t
        spans.append((ev.t, reverted_at))
    return spans


def _hit(target: str, inj: Event) -> str:
    """A fault's target as asked, with what a seeded pick (`one`, `all`, `fixed:N`, `percent:P`:
    chaos faults among them) hit: `one -> rank:3`; a target that names its rank, node or host as
    it stands."""
    if target.startswith(("rank:", "node:", "host:")):
        return target
    kind = str(inj.get("kind", ""))
    ranks = [str(r) for r in inj.get("ranks") or [] if isinstance(r, int)]
    nodes = [str(n) for n in inj.get("nodes") or [] if isinstance(n, int)]
    by_node = kind.endswith("-node") or kind.startswith(("net-", "link-"))
    hit = _target([], nodes) if by_node and nodes else _target(ranks, []) if ranks else ""
    return f"{target} -> {hit}" if hit and hit != "job" else target


def _target(ranks: list[str], nodes: list[str]) -> str:
    """`node:1`, `rank:3`, `node:1 rank:3`, or `job` for a failure that names neither (a hang)."""
    parts = [f"node:{','.join(nodes)}"] if nodes else []
    parts += [f"rank:{','.join(ranks)}"] if ranks else []
    return " ".join(parts) or "job"


def _detected_faults(events: list[Event], end_t: float) -> list[tuple[Event, Callable[[Event], bool]]]:
    """A fault of kind DETECTED for each `failure_detected` event that no injected fault explains:
    its `explained_by` is empty (`fault_ids` in an older record) and no injected fault with a
    duration was in force when it began (ffctl cannot tell a failure from an effect of such a
    fault). Each comes as a made-up `fault_injected` event at the failure's onset, with what
    picks the events that name it: the detection and the recoveries whose `failure_ids` hold its
    id (in a record without failure ids, the first recovery decided or failed after it)."""
    spans = _in_effect(events, end_t)
    committed = commits(events)
    out: list[tuple[Event, Callable[[Event], bool]]] = []
    count = 0
    for i, det in enumerate(events):
        if det.kind is not EventKind.FAILURE_DETECTED:
            continue
        count += 1  # the controller numbers every detected failure, explained or not
        explained = det.get("explained_by") if "explained_by" in det.data else det.get("fault_ids")
        onset, measured_from = _onset(det)
        if _ids(explained) or any(a <= onset <= b for a, b in spans):
            continue
        fid = rf.ident(det, "failure_id") if det.get("failure_id") else f"d{count}"
        if det.get("failure_id"):
            mentions = (lambda det, fid: lambda ev: ev is det or fid in _ids(ev.get("failure_ids")))(det, fid)
        else:
            outcome = _first(events[i + 1:], lambda ev: ev.kind in (EventKind.RECOVERY_DECIDED,
                                                                      EventKind.RECOVERY_FAILED))
            mentions = (lambda det, outcome: lambda ev: ev is det or (outcome is not None and ev is outcome))(
                det, outcome)
        ranks, nodes = _ids(det.get("ranks")), _ids(det.get("nodes"))
        gen = det.get("gen")
        made_up = Event(EventKind.FAULT_INJECTED, onset, {
            "fault_id": fid, "kind": DETECTED, "target": _target(ranks, nodes), "ranks": ranks, "nodes": nodes,
            "at_step": _step_at(committed, onset), "gen": int(gen) if isinstance(gen, int) else 0,
            "emulated": False, "breaks_job": True, "measured_from": measured_from,
        })
        out.append((made_up, mentions))
    return out


def _detected_stragglers(events: list[Event], end_t: float) -> list[tuple[Event, Callable[[Event], bool]]]:
    """A fault of kind DETECTED (cause "straggler") for each straggler the detector named that no
    injected fault explains (`fault_ids` empty, and no injected fault with a duration in force
    at its onset) and that was not replaced (a replaced one is a detected failure already):
    made up as `_detected_faults` does, at the slowdown's onset."""
    spans = _in_effect(events, end_t)
    committed = commits(events)
    out: list[tuple[Event, Callable[[Event], bool]]] = []
    for i, det in enumerate(events):
        if det.kind is not EventKind.STRAGGLER_DETECTED or _ids(det.get("fault_ids")):
            continue
        onset = det.get("onset_t")
        onset = float(onset) if isinstance(onset, (int, float)) and not isinstance(onset, bool) \
            and math.isfinite(onset) and onset <= det.t else det.t
        rank = rf.opt_count(det, "rank")
        if any(a <= onset <= b for a, b in spans) or _first(
                events[i + 1:], lambda ev: ev.kind is EventKind.FAILURE_DETECTED
                and STRAGGLER in rf.text(ev, "cause").split("+") and rank in rf.counts(ev, "ranks")):
            continue
        fid = f"s{sum(1 for ev in events[:i + 1] if ev.kind is EventKind.STRAGGLER_DETECTED)}"
        made_up = Event(EventKind.FAULT_INJECTED, onset, {
            "fault_id": fid, "kind": DETECTED, "target": _target([str(rank)], []), "ranks": [rank],
            "nodes": [rf.key(det, "node")], "at_step": _step_at(committed, onset), "gen": rf.gen(det),
            "emulated": False, "breaks_job": False, "measured_from": "onset", "cause": STRAGGLER,
        })
        out.append((made_up, (lambda det: lambda ev: ev is det)(det)))
    return out


def _healed_all(events: list[Event], decision: Event) -> bool:
    """Whether every rank the decision replaced got its shards from a live replica (HSDP): then
    that, not the copy the plan named, is where the lost state came from."""
    lost = set(rf.counts(decision, "ranks"))
    done = _first(events, lambda ev: ev.kind is EventKind.RESTORE_DONE and rf.gen(ev) == rf.gen(decision))
    healed = set(rf.nested_counts(done, "transfer", "healed")) if done is not None else set()
    return bool(lost) and lost <= healed


def _script_restore(events: list[Event], decision: Event, m: int) -> tuple[int | None, str, int | None]:
    """(restore_step, restore_source, lost_steps) of a plain script's restart, from the steps it
    reported: it restored itself to the step before the first one it reports again (`again`),
    and the steps from `again` to m are trained again. `again` at or below the first step the
    run ever reported means it started over (no checkpoint of its own, or none yet): nothing was
    restored (None, "none"), every step reported before the fault is lost. No step reported
    after the restart: where it went back to is unknown (None, "script", None); none reported
    before it: what it lost is (lost_steps None). A restore step is never below 0."""
    gen = rf.gen(decision)
    again = _first(events, lambda ev: ev.kind is EventKind.STEP and ev.t >= decision.t and rf.gen(ev) >= gen)
    if again is None:
        return None, RestoreSource.SCRIPT.value, None
    step = rf.step(again)
    restore_step = step - 1 if step > 0 else None
    first = _first(events, lambda ev: ev.kind is EventKind.STEP)
    if first is None or first is again:  # (None only for no step at all: `again` is one)
        return restore_step, RestoreSource.SCRIPT.value, None
    lost = max(0, m - step + 1)
    if step <= rf.step(first):
        return None, RestoreSource.NONE.value, lost
    return restore_step, RestoreSource.SCRIPT.value, lost


@dataclass(frozen=True)
class Commit:
    t: float
    step: int
    gen: int
    step_time_s: float


@dataclass(frozen=True)
class _LostWindow:
    start: float  # the last commit before the injection (the injection when there was none)
    end: float  # back at pace, else where the run's progress ended
    pace: float | None
    back_at: float | None


def commits(events: list[Event]) -> list[Commit]:
    """Every step commit, in record order (runs.projection measures step times from them too)."""
    return [Commit(ev.t, rf.step(ev), rf.gen(ev), rf.duration(ev, "step_time_s"))
            for ev in events if ev.kind is EventKind.STEP]


def step_interval(commits: list[Commit], i: int) -> float | None:
    """Wall time of the step committed at `commits[i]`, when the commit before it is the step
    before it in the same generation (a replay's first step or a new generation's is no pace)."""
    if i <= 0:
        return None
    a, b = commits[i - 1], commits[i]
    if b.step != a.step + 1 or b.gen != a.gen:
        return None
    return b.t - a.t


def _step_at(commits: list[Commit], t: float) -> int:
    """The step of the newest commit at or before `t`: where the job stood (a rollback lowers it,
    so replayed steps are no progress)."""
    step = 0
    for c in commits:
        if c.t > t:
            break
        step = c.step
    return step


def _lost_window(injected_at: float, fault_end: float | None, commits: list[Commit], end_t: float,
                 completed: bool) -> _LostWindow:
    before = [i for i, c in enumerate(commits) if c.t <= injected_at]
    start = commits[before[-1]].t if before else injected_at
    # The pace: the median wall time per step before the fault, from the commits' timestamps (what
    # the job delivered, input and reporting included); a single commit has only its own step_time_s.
    gaps = [g for g in (step_interval(commits, i) for i in before) if g is not None]
    pace: float | None = statistics.median(gaps) if gaps else (
        statistics.median(commits[i].step_time_s for i in before) if before else None)
    back_at = None
    if fault_end is not None:
        for j, c in enumerate(commits):
            if c.t < fault_end or j + BACK_WINDOW >= len(commits):
                continue
            window = [step_interval(commits, j + k) for k in range(1, BACK_WINDOW + 1)]
            if any(g is None for g in window):
                continue
            gaps_after = [float(g) for g in window if g is not None]
            if pace is None:
                # No step before the fault: the job's own pace once it runs again is the measure.
                pace = statistics.median(gaps_after)
            limit = (1.0 + PACE_TOLERANCE) * pace
            if gaps_after[0] <= limit and statistics.median(gaps_after) <= limit:
                back_at = c.t
                break
    if back_at is not None:
        end = back_at
    elif completed:
        # The job finished its steps without settling back to its pace: the loss runs to its last
        # step; the shutdown after it is no fault's doing.
        end = max([start] + [c.t for c in commits if c.t >= start])
    else:
        end = max(start, end_t)  # failed, interrupted, incomplete or still running: to the end
    return _LostWindow(start, end, pace, back_at)


def _lost_windows(windows: list[_LostWindow], commits: list[Commit]) -> list[float]:
    """Each window's lost seconds: its length less (steps gained) x pace, floored at zero.

    Where windows overlap, each stretch of time between two window edges is split evenly between
    the faults whose windows cover it (each at its own pace), so the faults' lost_s add up to the
    job's loss over the union of their windows: nothing is billed twice, and a fault that hit
    during another's recovery still carries its share.
    """
    lost = [0.0] * len(windows)
    cuts = sorted({w.start for w in windows} | {w.end for w in windows})
    for x, y in zip(cuts, cuts[1:]):
        active = [i for i, w in enumerate(windows) if w.start <= x and y <= w.end]
        if not active:
            continue
        gained = _step_at(commits, y) - _step_at(commits, x)
        for i in active:
            lost[i] += ((y - x) - gained * (windows[i].pace or 0.0)) / len(active)
    return [max(0.0, v) for v in lost]


def _revert_of(fid: str, events: list[Event]) -> tuple[float | None, str | None, bool | None]:
    """(when, by whom, ok) of the fault's revert. A fault guarded on several nodes counts as
    reverted by the dead man's switches once any has reported, ok only if every one was."""
    reverts = [ev for ev in events if ev.kind is EventKind.FAULT_REVERTED and rf.ident(ev, "fault_id") == fid]
    if not reverts:
        return None, None, None
    by_controller = [ev for ev in reverts if ev.get("by", "controller") != "deadman"]
    if by_controller:
        return by_controller[0].t, "controller", True
    return max(ev.t for ev in reverts), "deadman", all(ev.get("ok") is True for ev in reverts)


def run_status(events: list[Event], controller_alive: bool | None = None) -> str:
    """The run's status: its `run_finished` event's; without one, `incomplete` when the
    controller is known to be gone, else `running` (alive, or this machine cannot tell)."""
    finished = _first(events, lambda ev: ev.kind is EventKind.RUN_FINISHED)
    if finished is not None:
        return rf.text(finished, "status", "None")
    if controller_alive is False:
        return RunStatus.INCOMPLETE.value
    return RunStatus.RUNNING.value


CONTROLLER_LOST = "controller lost"


def _spare_seconds(events: list[Event], end_t: float) -> float:
    held: dict[Any, tuple[float, int]] = {}
    total = 0.0
    for ev in events:
        if ev.kind is EventKind.SPARES_HELD:
            node = rf.key(ev, "node")
            if node in held:
                since, count = held[node]
                total += count * (ev.t - since)
            held[node] = (ev.t, rf.count(ev, "count"))
    for since, count in held.values():
        total += count * max(0.0, end_t - since)
    return total


def compute(run_id: str, events: list[Event], controller_alive: bool | None = None) -> RunMetrics:
    """Every figure of `ffctl report`, from the events alone, and whether the controller of a
    run without `run_finished` is alive (None: unknown; see `run_status`)."""
    for ev in events:
        rf.time_of(ev)  # every figure below is a difference of these times
    started = _first(events, lambda ev: ev.kind is EventKind.RUN_STARTED)
    finished = _first(events, lambda ev: ev.kind is EventKind.RUN_FINISHED)
    world_size = rf.count(started, "world_size") if started else 0
    plain_script = bool(started.get("plain_script", False)) if started else False
    strategy = run_strategy(rf.text(started, "strategy"), plain_script) if started else ""
    start_t = started.t if started else (events[0].t if events else 0.0)
    # A switch that reverted after the controller died says nothing of how long the job ran.
    own = [ev for ev in events if ev.get("by") != "deadman"] or events
    end_t = finished.t if finished else (own[-1].t if own else start_t)
    status = run_status(events, controller_alive)
    reason = CONTROLLER_LOST if status == RunStatus.INCOMPLETE.value else finish_reason(events)
    losses = final_losses(events)
    faults = [
        _fault_metrics(ev, events, world_size, end_t)
        for ev in events
        if ev.kind is EventKind.FAULT_INJECTED
    ]
    # Failures ffctl did not inject count as faults too, in time order with the injected ones.
    faults += [_fault_metrics(ev, events, world_size, end_t, mentions)
               for ev, mentions in _detected_faults(events, end_t) + _detected_stragglers(events, end_t)]
    faults.sort(key=lambda f: f.injected_at)
    committed = commits(events)
    windows = []
    for f in faults:
        # The fault ended when it was recovered from and, if it was reverted, reverted: a hang
        # the job got past at once (step m+1 was already reduced) still stalls it until then.
        ends = [t for t in (f.resumed_at, f.reverted_at) if t is not None]
        fault_end = max(ends) if ends and (f.recovered or f.reverted_at is not None) else None
        windows.append(_lost_window(f.injected_at, fault_end, committed, end_t,
                                    status == RunStatus.COMPLETED.value))
    lost = _lost_windows(windows, committed)
    # Without steps there is no pace to measure against: the restart time is what is known lost.
    lost = [x if f.step_known else (f.recovery_s or 0.0) for f, x in zip(faults, lost)]
    faults = [
        replace(f, lost_s=lost_s, pace_s=w.pace, back_at_pace_at=w.back_at,
                lost_gpu_hours=world_size * lost_s / 3600.0)
        for f, w, lost_s in zip(faults, windows, lost)
    ]
    wall = end_t - start_t
    useful = sum(_final_step_times(events, plain_script).values())
    # A plain script that reports no steps has trained an unknown share of its wall time: no
    # goodput (shown "-"), never a false 0.
    goodput = (useful / wall) if wall > 0 and (committed or not plain_script) else None
    return RunMetrics(
        run_id=run_id,
        status=status,
        strategy=strategy,
        world_size=world_size,
        steps_completed=max(losses) if losses else 0,
        final_loss=losses[max(losses)] if losses else None,
        loss_by_step=[[step, losses[step]] for step in sorted(losses)],
        faults=faults,
        lost_gpu_hours_total=sum(f.lost_gpu_hours for f in faults),
        spare_gpu_hours=_spare_seconds(events, end_t) / 3600.0,
        goodput=goodput,
        wall_s=wall,
        reason=reason,
        messages_rejected=sum(1 + rf.count(ev, "dropped_before") + rf.count(ev, "unreported_before")
                              for ev in events if ev.kind is EventKind.MESSAGE_REJECTED),
        step_known=bool(committed) or not plain_script,
        unprotected_s=_unprotected_seconds(events, end_t),
        missed_faults=[{k: rf.text(ev, k, "None") for k in ("fault_id", "kind", "target", "trigger", "reason")}
                       for ev in events if ev.kind is EventKind.FAULT_MISSED],
    )


def _unprotected_seconds(events: list[Event], end_t: float) -> float:
    """The time some node's ranks had no copy on another node: the union of each node's windows
    from `protection_lost` to its `protection_restored` (or the end of the run)."""
    opened: dict[Any, float] = {}
    windows: list[tuple[float, float]] = []
    for ev in events:
        if ev.kind not in (EventKind.PROTECTION_LOST, EventKind.PROTECTION_RESTORED):
            continue
        node = rf.key(ev, "node")
        if ev.kind is EventKind.PROTECTION_LOST and node not in opened:
            opened[node] = ev.t
        elif ev.kind is EventKind.PROTECTION_RESTORED and node in opened:
            windows.append((opened.pop(node), ev.t))
    windows += [(t, max(t, end_t)) for t in opened.values()]
    total, reach = 0.0, -math.inf
    for start, stop in sorted(windows):
        if stop > reach:
            total += stop - max(start, reach)
            reach = stop
    return total
