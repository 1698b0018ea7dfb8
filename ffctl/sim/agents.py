"""The simulated-agent process (`python -m ffctl.sim`): many node agents and their ranks in one
process, speaking the real control protocol to a real controller, doing no torch work.

What each simulated agent does over the controller's store is what `ffctl.agent.agent.Agent`
does, through the same functions and sealed messages: it announces itself (`agent_up`, `spares`
with a warm template), beats a sealed heartbeat into `hb/<node>` every HEARTBEAT_S, reads its own
command queue (`control.Receiver`) and carries out what the controller sends (`spawn`, `kill`,
`neighbor`, `inventory`, `stop`), and reports `replicated` at most once a second. Each simulated
rank has its own sealer, as a real rank does: it says `started`, finds the newest plan as ranks
do (`control.newest_plan`, a look every 10 ms), reports `joined` and `restored`, a `step` per
step and `done`, and answers its generation's abort with `abort_seen` and `aborted`.

What is simulated: the training. Steps are committed in lockstep (a collective) every `step_s`
once every rank of the generation has joined, and never while a generation is aborted or a
node has been lost, as survivors blocked in a collective would be. Snapshots are bookkeeping:
each rank's slots hold its two newest steps, and the ring neighbour the controller wired
(`neighbor`) holds replicas of them. A rank joins once every rank of its generation has read
the plan (the rendezvous, which real ranks do through torch's store, is a barrier here).

What one process does differently from a thousand hosts, so that it keeps their pace on a core
or two, none of it visible to the controller: agents and ranks share a few store connections
(one per shard of agents, one for every heartbeat, one per generation's abort flags) instead
of two or three each; a shard reads all its queues' counters in one `multi_get` and reads a
queue only when its counter moved, where each real agent reads its own every 20 ms; an agent
does not read its last heartbeat back before the next (a tamper check that costs the controller
nothing); one watcher per generation waits on every rank's abort flag, where each real rank
waits on its own; ranks run as state machines on the shard threads, not as threads of their
own; and a plan value is opened and decoded once per process, though every rank reads it from
the store, since real ranks do that work side by side on their own hosts.

The backend (`ffctl.sim.nodes`) talks to this process in JSON lines: on stdin `{"op": "start",
"cfg": AgentConfig}` and `{"op": "stop", "node": n, "incarnation": i}`; on stdout `exited`
(an agent ended), `killed` (the node the bench loses), `step` marks (time, this process's CPU,
the store's key count) and, at the end of stdin, a `summary` of when each generation's plan was
first and last read.
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch.distributed as dist

from ffctl.agent.config import AgentConfig
from wire import control, messages
from wire.generation_plan import GenerationPlan, LocalSlot
from runs.events import RestoreHow

HEARTBEAT_S = 0.2  # as ffctl.agent.agent
POLL_S = 0.02  # as ffctl.agent.agent
REPLICATED_S = 1.0  # as ffctl.agent.replicator.REPORT_S
PLAN_POLL_S = 0.01  # as wire.control.newest_plan
WATCH_TIMEOUT = datetime.timedelta(hours=1)
MAX_RANKS = 1 << 20
# Threads that drive the agents' loops (heartbeats, queues): the store calls release the GIL,
# so a few overlap their round trips.
SHARDS = 4
_FIRST_PID = 1 << 22  # simulated ranks' pids: never 0, which the controller reads as "no process"


@dataclass(frozen=True)
class SimSpec:
    """What the simulated job does: `steps` steps, one every `step_s` seconds, and node
    `kill_node` lost (silent: no heartbeat, no word from it or its ranks) once step `kill_step`
    is committed."""

    steps: int
    step_s: float = 0.5
    kill_node: int | None = None
    kill_step: int | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SimSpec:
        return cls(**json.loads(text))


class _Answer:
    """A store that answers one value: hands an already read value to the library's decoder."""

    def __init__(self, raw: bytes) -> None:
        self._raw = raw

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return self._raw


class SharedReader(control.Reader):
    """`control.Reader` whose plan reads are real store round trips, but whose opening and
    decoding of a plan value happens once per process (real ranks do it on their own hosts)."""

    _cache: dict[tuple[int, bytes], GenerationPlan] = {}
    _cache_lock = threading.Lock()

    def plan(self, store: control.Store, gen: int) -> GenerationPlan | None:
        raw = control.read(store, control.gen_plan_key(gen))
        if raw is None:
            return None
        with self._cache_lock:
            hit = self._cache.get((gen, raw))
        if hit is not None:
            return hit
        plan = super().plan(_Answer(raw), gen)  # type: ignore[arg-type]  # a store for the one read it makes
        if plan is not None:
            with self._cache_lock:
                self._cache[(gen, raw)] = plan
        return plan


class Sim:
    """Every simulated agent and rank of this process, and the lockstep training they share."""

    def __init__(self, spec: SimSpec, emit: Callable[[dict[str, Any]], None]) -> None:
        self.spec = spec
        self.emit = emit
        self.lock = threading.Condition()
        self.agents: dict[int, SimAgent] = {}  # node -> its current agent
        self.by_port: dict[int, int] = {}  # a simulated snapshot-store port -> its node
        self.gen = -1  # the newest generation every rank has joined
        self.world = 0
        self.arrived: dict[int, set[int]] = {}  # gen -> ranks that read its plan
        self.joined: dict[int, set[int]] = {}  # gen -> ranks that reported joined
        self.aborted: set[int] = set()  # generations whose abort was seen
        self.step = 0  # the newest step committed
        self.killed_at: float | None = None
        self._killed_gen = -1  # the generation the lost node was in
        self.plan_seen: dict[int, list[float]] = {}  # gen -> [first read, last read, reads]
        self.shutting = threading.Event()
        self._conns: dict[int, dist.TCPStore] = {}
        self._watched: set[int] = set()  # generations whose abort flags are watched
        self._pids = _FIRST_PID
        self._started = time.monotonic()

    def conn(self, cfg: AgentConfig, shard: int) -> dist.TCPStore:
        """The store connection of `shard`, shared by its agents and ranks (made once)."""
        with self.lock:
            store = self._conns.get(shard)
            if store is None:
                store = self._conns[shard] = control.connect(cfg.store_host, cfg.store_port, timeout=60.0)
            return store

    def watch(self, cfg: AgentConfig, gen: int, world: int) -> None:
        """Watch generation `gen`'s abort flags (once per generation, on a connection of its own)."""
        with self.lock:
            if gen in self._watched:
                return
            self._watched.add(gen)
        threading.Thread(target=self._watch, args=(cfg, gen, world), name=f"sim-abort-{gen}", daemon=True).start()

    def _watch(self, cfg: AgentConfig, gen: int, world: int) -> None:
        """Block until the controller's sealed abort of `gen` is set (it sets every rank's flag at
        once), then wake the cohorts of that generation: each answers for its ranks."""
        opener = control.Opener(cfg.token)
        keys = [control.gen_abort_key(gen, r) for r in range(world)]
        try:
            store = control.connect(cfg.store_host, cfg.store_port, timeout=10.0)
            while not self.shutting.is_set():
                store.wait(keys, WATCH_TIMEOUT)
                raw = control.read(store, keys[0])
                try:
                    if raw is not None:
                        opener.open(raw, keys[0], replay=False)
                        break
                except control.Rejected:
                    pass
                time.sleep(0.05)
        except Exception:  # the controller is gone: nothing to watch any more
            return
        with self.lock:
            self.aborted.add(gen)
            cohorts = [c for a in self.agents.values() for c in a.cohorts if c.gen == gen]
        for c in cohorts:
            c.abort.set()

    def next_pid(self) -> int:
        with self.lock:
            self._pids += 1
            return self._pids

    # -- the rendezvous and the lockstep steps --------------------------------------------------
    def arrive(self, gen: int, plan: GenerationPlan, ranks: list[int]) -> None:
        """`ranks` read generation `gen`'s plan (the rendezvous counts them)."""
        now = time.time()
        with self.lock:
            seen = self.plan_seen.setdefault(gen, [now, now, 0])
            seen[1], seen[2] = now, seen[2] + len(ranks)
            self.world = plan.world_size
            self.arrived.setdefault(gen, set()).update(ranks)

    def arrived_all(self, gen: int, world: int) -> bool | None:
        """Whether every rank of `gen` has read its plan (the barrier); None: a newer generation
        is being joined, so `gen` never will be."""
        with self.lock:
            if max(self.arrived) > gen:
                return None
            return len(self.arrived.get(gen, ())) >= world

    def joined_gen(self, gen: int, ranks: list[int], restore_step: int) -> None:
        with self.lock:
            got = self.joined.setdefault(gen, set())
            got.update(ranks)
            if len(got) >= self.world and gen > self.gen:
                self.gen = gen
                self.step = restore_step

    def trainer(self) -> None:
        """Commit a step every `step_s` while the newest generation is whole and not aborted."""
        next_at = time.monotonic() + self.spec.step_s
        while not self.shutting.wait(max(0.0, next_at - time.monotonic())):
            next_at += self.spec.step_s
            with self.lock:
                gen, step = self.gen, self.step
                if gen < 0 or gen in self.aborted or step >= self.spec.steps:
                    continue
                if self.killed_at is not None and gen <= self._killed_gen:
                    continue  # the survivors wait in the collective the lost node never joins
                if (self.spec.kill_node is not None and self.killed_at is None and self.spec.kill_step is not None
                        and step >= self.spec.kill_step):
                    self._kill(gen, self.spec.kill_node)
                    continue
                step += 1
                self.step = step
                cohorts = [c for a in self.agents.values() if not a.dead for c in a.cohorts if c.gen == gen and c.ranks]
            self._commit(cohorts, gen, step)

    def _kill(self, gen: int, node: int) -> None:
        """Lose `node` (lock held): its agent and ranks fall silent at once."""
        agent = self.agents.get(node)
        self.killed_at = time.time()
        self._killed_gen = gen
        if agent is not None:
            agent.dead = True
        self.emit({"ev": "killed", "node": node, "t": self.killed_at, "step": self.step})

    def _commit(self, cohorts: list[Cohort], gen: int, step: int) -> None:
        t0 = time.time()
        for c in cohorts:
            c.commit(gen, step, self.spec.step_s)
        if step >= self.spec.steps:
            for c in cohorts:
                for r in list(c.ranks):
                    c.send(r, messages.Done, gen=gen, step=step)
        keys = None
        try:
            keys = int(cohorts[0].store.num_keys()) if cohorts else None
        except Exception:  # a figure of the bench, not the protocol
            pass
        self.emit({"ev": "step", "step": step, "gen": gen, "t": t0, "sent_s": round(time.time() - t0, 6),
                   "cpu_s": time.process_time(), "keys": keys})

    # -- snapshots ------------------------------------------------------------------------------
    def holder(self, agent: SimAgent) -> SimAgent | None:
        node = self.by_port.get(agent.neighbor_port or 0)
        holder = self.agents.get(node) if node is not None else None
        return holder if holder is not None and not holder.dead else None

    def heartbeats(self) -> None:
        """Beat for every live agent, on a thread and connection of its own: a real agent beats
        whatever its ranks do, and so must these, however busy the shards are."""
        store: dist.TCPStore | None = None
        while not self.shutting.wait(0.01):
            with self.lock:
                live = [a for a in self.agents.values() if not a.dead and not a.stopped]
            if not live:
                continue
            try:
                if store is None:
                    cfg = live[0].cfg
                    store = control.connect(cfg.store_host, cfg.store_port, timeout=10.0)
                now = time.monotonic()
                for agent in live:
                    agent.beat(store, now)
            except Exception as exc:  # the controller is gone
                print(f"ffctl sim: heartbeats: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

    def shard_loop(self, shard: int) -> None:
        """Run the loops of the agents `node % SHARDS == shard`: heartbeats, command queues and
        their ranks. A real agent reads its queue's counter every POLL_S; here one `multi_get`
        per shard reads every counter of the shard at once, and only a queue whose counter moved
        is read, so that one process can poll a thousand queues at the real cadence."""
        polled = 0.0
        while not self.shutting.is_set():
            now = time.monotonic()
            with self.lock:
                mine = [a for n, a in self.agents.items() if n % SHARDS == shard and not a.dead and not a.stopped]
            moved: set[int] = set()
            if mine and now - polled >= POLL_S:
                polled = now
                try:
                    counters = mine[0].store.multi_get([a.inbox_counter for a in mine])
                    moved = {a.node for a, raw in zip(mine, counters) if bytes(raw) != a.counter_seen}
                    for a, raw in zip(mine, counters):
                        a.counter_seen = bytes(raw)
                except Exception as exc:  # the controller is gone
                    print(f"ffctl sim: shard {shard}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            for agent in mine:
                try:
                    agent.tick(now, agent.node in moved)
                except Exception as exc:  # an agent whose store call failed
                    print(f"ffctl sim: agent {agent.node}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            self.shutting.wait(0.002)


class Cohort:
    """Ranks of one node that joined a generation together, run as a state machine by their
    agent's shard thread (a real rank has a thread of its own and blocks; thousands of threads
    in one process would starve each other of the interpreter instead).

    starting (spawned: says `started`) -> plan (reads the newest plan every PLAN_POLL_S, as
    `control.newest_plan` does) -> barrier (every rank of the generation has read it) ->
    running (said `joined`, `restored`) -> on the generation's abort: `abort_seen`, `aborted`,
    and plan again."""

    def __init__(self, sim: Sim, agent: SimAgent, gen: int, ranks: list[int], spawned: bool) -> None:
        self.sim = sim
        self.agent = agent
        self.gen = gen
        self.ranks = set(ranks)
        self.pids = {r: sim.next_pid() for r in ranks}
        cfg = agent.cfg
        self.store = agent.store
        self.abort = threading.Event()  # set by the generation's watcher (`Sim.watch`)
        self.sealers = {r: control.Sealer(cfg.token, f"rank/{r}") for r in ranks}
        self.reader = SharedReader(control.Opener(cfg.token), None)
        self.last = 0  # the newest step committed
        self.state = "starting" if spawned else "running"
        self._want = gen  # the generation whose plan (or a newer one) is looked for
        self._next_poll = 0.0
        self._found: tuple[int, GenerationPlan] | None = None

    def send(self, rank: int, kind: type[messages.Message], **fields: Any) -> None:
        msg = kind(rank=rank, node=self.agent.node, **fields)  # type: ignore[call-arg]  # a kind a rank sends
        control.send(self.store, control.CTL_QUEUE, msg, self.sealers[rank])

    def alive(self) -> bool:
        return bool(self.ranks) and not self.agent.dead and not self.agent.stopped and not self.sim.shutting.is_set()

    def commit(self, gen: int, step: int, dt: float) -> None:
        self.last = step
        for r in list(self.ranks):
            self.send(r, messages.Step, gen=gen, step=step, loss=1.0 / step, dt=dt)
            self.agent.held[r] = {step - 1, step}
        holder = self.sim.holder(self.agent)
        if holder is not None:
            for r in self.ranks:
                holder.replicas[r] = {step - 1, step}

    def tick(self, now: float) -> None:
        if not self.alive():
            return
        if self.state == "starting":
            for r in sorted(self.ranks):
                self.send(r, messages.Started, gen=self.gen, pid=self.pids[r])
            self.state = "plan"
        if self.state == "running" and self.abort.is_set():
            self.abort.clear()
            for r in sorted(self.ranks):
                self.send(r, messages.AbortSeen, gen=self.gen)
            for r in sorted(self.ranks):
                self.send(r, messages.Aborted, gen=self.gen, step=self.last, reason="peer failure")
            self._want, self.state = self.gen + 1, "plan"
        if self.state == "plan" and now >= self._next_poll:
            self._next_poll = now + PLAN_POLL_S
            try:
                # One look, as each of newest_plan's polls (its deadline already passed).
                self._found = control.newest_plan(self.store, self._want, 0.0, reader=self.reader)
            except TimeoutError:
                return
            self.sim.arrive(self._found[0], self._found[1], sorted(self.ranks))
            self.state = "barrier"
        if self.state == "barrier":
            assert self._found is not None
            gen, plan = self._found
            arrived = self.sim.arrived_all(gen, plan.world_size)
            if arrived is None:
                self._want, self.state = gen + 1, "plan"  # a newer generation opened meanwhile
            elif arrived:
                self._join(gen, plan)

    def _join(self, gen: int, plan: GenerationPlan) -> None:
        step = plan.restore_step
        for r in sorted(self.ranks):
            self.send(r, messages.Joined, gen=gen)
        for r in sorted(self.ranks):
            if plan.restores:
                src = plan.source(r)
                how = RestoreHow.KEPT if isinstance(src, LocalSlot) and src.node == self.agent.node else RestoreHow.RECEIVED
                self.send(r, messages.Restored, gen=gen, step=step, source=src.kind, how=how)
            self.agent.held[r] = {step}
        self.gen, self.last, self.state = gen, step, "running"
        self.sim.joined_gen(gen, sorted(self.ranks), step)
        self.sim.watch(self.agent.cfg, gen, plan.world_size)


class SimAgent:
    """One node's agent: its connection, sealer, heartbeat, command queue and snapshot holdings."""

    def __init__(self, sim: Sim, cfg: AgentConfig) -> None:
        self.sim = sim
        self.cfg = cfg
        self.node = cfg.node
        self.store = sim.conn(cfg, cfg.node % SHARDS)
        self.sealer = control.Sealer(cfg.token, f"agent/{cfg.node}")
        self.inbox = control.Receiver(self.store, control.agent_queue(cfg.node, cfg.incarnation),
                                      opener=control.Opener(cfg.token), on_reject=self._rejected)
        self.limits = control.Limits(MAX_RANKS, cfg.nnodes)
        self.port = 20000 + cfg.node  # its simulated snapshot store (never listened on)
        self.neighbor_port: int | None = None
        self.cohorts: list[Cohort] = []
        self.held: dict[int, set[int]] = {}  # rank -> steps in its local slots
        self.replicas: dict[int, set[int]] = {}  # rank -> steps of the neighbour's ranks held here
        self.dead = False  # lost: silent from now on
        self.stopped = False
        self.beats = 0
        self.inbox_counter = f"{self.inbox.queue}/n"
        self.counter_seen = b""
        self._next_beat = 0.0
        self._next_poll = 0.0
        self._replicated_at = -REPLICATED_S
        self._replicated = 0

    def start(self) -> None:
        self.report(messages.AgentUp, pid=os.getpid(), host=f"sim{self.node}", time=time.time(),
                    peer_address="127.0.0.1", peer_port=self.port)
        self.report(messages.Spares, count=0, total=0, template=True)

    def report(self, kind: type[messages.Message], **fields: Any) -> None:
        msg = messages.from_agent(kind, self.node, self.cfg.incarnation, **fields)
        control.send(self.store, control.CTL_QUEUE, msg, self.sealer)

    def _rejected(self, where: str, index: int, reason: str, raw: bytes) -> None:
        self.report(messages.Refusal, where=where, index=index, reason=reason, raw=control.short_repr(raw))

    def tick(self, now: float, moved: bool) -> None:
        if moved:
            for raw in self.inbox.poll():
                self._handle(raw)
        if now >= self._next_poll:
            self._next_poll = now + POLL_S
            self._report_replicated(now)
        for cohort in list(self.cohorts):
            cohort.tick(now)

    def beat(self, store: dist.Store, now: float) -> None:
        """Beat if due. As ffctl.agent.heartbeat.Heartbeat.beat, less its read-back of the last beat (a
        check against tampering that costs the agent a round trip and the controller nothing)."""
        if now < self._next_beat:
            return
        self._next_beat = now + HEARTBEAT_S
        key = control.heartbeat_key(self.node)
        self.beats += 1
        beat = messages.Heartbeat(node=self.node, incarnation=self.cfg.incarnation, beat=self.beats)
        control.store_set(store, key, self.sealer.seal(key, beat.to_dict()).encode())

    def _report_replicated(self, now: float) -> None:
        if now - self._replicated_at < REPLICATED_S or self.sim.holder(self) is None:
            return
        ranks = sorted(r for c in self.cohorts if c.alive() for r in c.ranks)
        step = min((max(self.held.get(r, {0})) for r in ranks), default=0)
        if ranks and step > self._replicated:
            self._replicated, self._replicated_at = step, now
            self.report(messages.Replicated, step=step, ranks=ranks)

    def _handle(self, raw: dict[str, Any]) -> None:
        try:
            cmd = messages.decode(raw, self.limits, command=True)
        except messages.DecodeError as exc:
            self._rejected(self.inbox.queue, -1, exc.reason, json.dumps(raw)[:200].encode())
            return
        if isinstance(cmd, messages.Spawn):
            ranks = [int(spec["rank"]) for spec in cmd.ranks]
            cohort = Cohort(self.sim, self, cmd.gen, ranks, spawned=True)
            self.cohorts = [c for c in self.cohorts if c.ranks] + [cohort]
            self.report(messages.Spawned, gen=cmd.gen, pids={str(r): p for r, p in cohort.pids.items()},
                        how={str(r): "template" for r in ranks}, start_s={str(r): 0.0 for r in ranks})
        elif isinstance(cmd, messages.Kill):
            for c in self.cohorts:
                for r in [r for r in cmd.ranks if r in c.ranks]:
                    c.ranks.discard(r)  # (its slots stay: a real agent keeps them too)
                    self.report(messages.RankExited, rank=r, gen=c.gen, pid=c.pids[r], exitcode=-15,
                                expected=True, host=f"sim{self.node}")
        elif isinstance(cmd, messages.Neighbor):
            self.neighbor_port = cmd.holders[0][1] if cmd.holders else None
        elif isinstance(cmd, messages.InventoryRequest):
            local = {str(r): sorted(s) for r, s in self.held.items()}
            self.report(messages.Inventory, req=cmd.req, local=local,
                        replica={str(r): sorted(s) for r, s in self.replicas.items()})
        elif isinstance(cmd, messages.Stop):
            self.stopped = True
            self.sim.emit({"ev": "exited", "node": self.node, "incarnation": self.cfg.incarnation, "code": 0})


def main(argv: list[str]) -> int:
    spec = SimSpec.from_json(argv[0])
    out_lock = threading.Lock()

    def emit(event: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(event) + "\n")
            sys.stdout.flush()

    threading.stack_size(512 * 1024)  # a thread per cohort: thousands of them at 1,024 nodes
    sim = Sim(spec, emit)
    for shard in range(SHARDS):
        threading.Thread(target=sim.shard_loop, args=(shard,), name=f"sim-shard-{shard}", daemon=True).start()
    threading.Thread(target=sim.trainer, name="sim-trainer", daemon=True).start()
    threading.Thread(target=sim.heartbeats, name="sim-heartbeats", daemon=True).start()
    for line in sys.stdin:
        try:
            op = json.loads(line)
            if op["op"] == "start":
                cfg = AgentConfig.from_json(op["cfg"])
                agent = SimAgent(sim, cfg)
                with sim.lock:
                    old = sim.agents.get(cfg.node)
                    if old is not None:
                        old.dead = True
                    sim.agents[cfg.node] = agent
                    sim.by_port[agent.port] = cfg.node
                agent.start()
            elif op["op"] == "stop":
                with sim.lock:
                    gone = sim.agents.get(int(op["node"]))
                if gone is not None and gone.cfg.incarnation == int(op["incarnation"]) and not gone.stopped:
                    gone.stopped = True
                    emit({"ev": "exited", "node": gone.node, "incarnation": gone.cfg.incarnation,
                          "code": -9 if gone.dead else 0})
                else:
                    emit({"ev": "exited", "node": int(op["node"]), "incarnation": int(op["incarnation"]), "code": 0})
        except Exception as exc:  # said, and the process goes on with the next line
            print(f"ffctl sim: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    sim.shutting.set()
    with sim.lock:
        sim.lock.notify_all()
    emit({"ev": "summary", "killed_at": sim.killed_at, "cpu_s": time.process_time(),
          "plans": {str(g): {"first": s[0], "last": s[1], "reads": s[2]} for g, s in sim.plan_seen.items()}})
    # Cohort watchers may still block in the store (its server is gone with the controller):
    # end without waiting for them or for torch's destructors.
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
