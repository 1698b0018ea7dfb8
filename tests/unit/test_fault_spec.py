"""Fault specs (`KIND:key=value,...`) and their targets resolved against a topology.

Covers docs/guides/faults.md's examples, `t=` triggers, the seeded modes one/all/fixed:N/percent:P, and every
error path: each is a `FaultSpecError` with one line naming the bad value.
"""
from __future__ import annotations

import pytest

from fault_injectors.plan import NodePlace, RankPlace, Topology
from wire.fault_spec import (
    FaultFamily,
    FaultKind,
    FaultSpec,
    FaultSpecError,
    Target,
    TargetMode,
    Trigger,
    parse_mode,
    parse_spec,
)
from fault_injectors.targets import resolve


def topology(nnodes: int = 2, nproc: int = 4) -> Topology:
    """`nnodes` hosts with `nproc` ranks each; ranks numbered node-major."""
    nodes = tuple(
        NodePlace(node=n, host=f"host{n}", address=f"10.0.0.{n + 1}", agent_pid=1000 + n)
        for n in range(nnodes)
    )
    ranks = tuple(
        RankPlace(rank=n * nproc + i, node=n, pid=2000 + n * nproc + i)
        for n in range(nnodes)
        for i in range(nproc)
    )
    return Topology(run_id="r1", nodes=nodes, ranks=ranks)


TOPO = topology()  # 2 nodes, ranks 0-3 on node 0 and 4-7 on node 1
ALL_RANKS = tuple(range(8))


def spec_error(text: str) -> str:
    with pytest.raises(FaultSpecError) as exc:
        parse_spec(text)
    message = str(exc.value)
    assert "\n" not in message
    return message


def resolve_error(text: str, topo: Topology = TOPO) -> str:
    spec = parse_spec(text)
    with pytest.raises(FaultSpecError) as exc:
        resolve(spec, topo)
    message = str(exc.value)
    assert "\n" not in message
    return message


# --------------------------------------------------------------------------------------------
# The design's examples
# --------------------------------------------------------------------------------------------


def test_kill_rank_at_step() -> None:
    spec = parse_spec("kill-rank:rank=1,step=25")
    assert spec.kind is FaultKind.KILL_RANK
    assert spec.kind.family is FaultFamily.PROCESS
    assert spec.target == Target(TargetMode.RANK, 1)
    assert spec.trigger == Trigger(step=25)
    assert spec.duration is None
    assert spec.seed == 0
    assert spec.options == ()
    assert str(spec) == "kill-rank rank:1 @step=25"
    assert resolve(spec, TOPO) == ((1,), (0,))


def test_kill_node_at_step() -> None:
    spec = parse_spec("kill-node:node=1,step=40")
    assert spec.kind is FaultKind.KILL_NODE
    assert spec.kind.family is FaultFamily.NODE
    assert spec.target == Target(TargetMode.NODE, 1)
    assert spec.trigger == Trigger(step=40)
    assert str(spec) == "kill-node node:1 @step=40"
    # A node fault hits the node; its ranks go with it but the fault is planned per node.
    assert resolve(spec, TOPO) == ((), (1,))


def test_net_partition_with_duration() -> None:
    spec = parse_spec("net-partition:node=1,step=30,duration=5")
    assert spec.kind is FaultKind.NET_PARTITION
    assert spec.kind.family is FaultFamily.NETWORK
    assert spec.target == Target(TargetMode.NODE, 1)
    assert spec.trigger == Trigger(step=30)
    assert spec.duration == 5.0
    assert resolve(spec, TOPO) == ((), (1,))


def test_spaces_around_fields_are_ignored() -> None:
    assert parse_spec(" kill-rank : rank=1 , step=25 ,") == parse_spec("kill-rank:rank=1,step=25")


# --------------------------------------------------------------------------------------------
# Triggers, targets, options
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds", "shown"),
    [
        ("hang-rank:rank=2,t=30", 30.0, "@t=30"),
        ("hang-rank:rank=2,t=12.5", 12.5, "@t=12.5"),
        ("hang-rank:rank=2,t=90s", 90.0, "@t=90"),
        ("hang-rank:rank=2,t=0", 0.0, "@t=0"),
    ],
)
def test_time_trigger(text: str, seconds: float, shown: str) -> None:
    spec = parse_spec(text)
    assert spec.trigger.t == seconds
    assert spec.trigger.step is None
    assert str(spec.trigger) == shown


def test_no_trigger_means_now_and_no_target_means_one() -> None:
    spec = parse_spec("term-rank")
    assert spec.trigger == Trigger()
    assert str(spec.trigger) == "now"
    assert spec.target == Target(TargetMode.ONE)


def test_duration_in_seconds_with_suffix() -> None:
    assert parse_spec("hang-rank:rank=0,duration=2.5s").duration == 2.5


def test_host_target() -> None:
    spec = parse_spec("link-down:host=host1,t=5")
    assert spec.target == Target(TargetMode.HOST, "host1")
    assert str(spec.target) == "host:host1"
    assert resolve(spec, TOPO) == ((), (1,))
    # A rank-level kind on a host hits every rank there.
    assert resolve(parse_spec("gpu-hang:host=host0"), TOPO) == ((0, 1, 2, 3), (0,))


def test_rank_kind_on_a_node_hits_the_nodes_ranks() -> None:
    assert resolve(parse_spec("gpu-error:node=1"), TOPO) == ((4, 5, 6, 7), (1,))
    assert resolve(parse_spec("crash-rank:rank=6"), TOPO) == ((6,), (1,))


def test_network_kind_on_a_rank_hits_its_node() -> None:
    assert resolve(parse_spec("net-delay:rank=5,delay=100ms"), TOPO) == ((), (1,))


def test_kind_specific_options_are_kept_in_order() -> None:
    spec = parse_spec("net-port-block:node=0,port=7400,action=reject,t=3")
    assert spec.options == (("port", "7400"), ("action", "reject"))
    assert spec.option("port") == "7400"
    assert spec.option("rate") is None
    assert spec.option("rate", "1mbit") == "1mbit"


@pytest.mark.parametrize("kind", list(FaultKind))
def test_every_kind_parses(kind: FaultKind) -> None:
    assert parse_spec(f"{kind.value}:step=3").kind is kind


# --------------------------------------------------------------------------------------------
# Seeded modes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "target"),
    [
        ("one", Target(TargetMode.ONE)),
        ("all", Target(TargetMode.ALL)),
        ("fixed:3", Target(TargetMode.FIXED, 3)),
        ("percent:50", Target(TargetMode.PERCENT, 50)),
    ],
)
def test_mode_parses(mode: str, target: Target) -> None:
    spec = parse_spec(f"kill-rank:mode={mode},seed=7,step=10")
    assert spec.target == target
    assert str(spec.target) == mode
    assert spec.seed == 7
    assert parse_mode(mode) == target


def test_mode_one_picks_one_rank_and_its_node() -> None:
    ranks, nodes = resolve(parse_spec("kill-rank:mode=one,seed=3"), TOPO)
    assert len(ranks) == 1 and ranks[0] in ALL_RANKS
    assert nodes == (TOPO.rank(ranks[0]).node,)


def test_mode_all() -> None:
    assert resolve(parse_spec("kill-rank:mode=all"), TOPO) == (ALL_RANKS, (0, 1))
    assert resolve(parse_spec("kill-node:mode=all"), TOPO) == ((), (0, 1))


def test_mode_fixed_picks_distinct_targets() -> None:
    ranks, nodes = resolve(parse_spec("kill-rank:mode=fixed:3,seed=11"), TOPO)
    assert len(ranks) == 3 == len(set(ranks))
    assert set(ranks) <= set(ALL_RANKS)
    assert list(ranks) == sorted(ranks)
    assert set(nodes) == {TOPO.rank(r).node for r in ranks}
    # The whole pool is allowed.
    assert resolve(parse_spec("kill-rank:mode=fixed:8,seed=11"), TOPO)[0] == ALL_RANKS


@pytest.mark.parametrize(("pct", "count"), [(50, 4), (100, 8), (30, 2), (1, 1), (12, 1), (13, 1)])
def test_mode_percent_counts(pct: int, count: int) -> None:
    ranks, _ = resolve(parse_spec(f"kill-rank:mode=percent:{pct},seed=5"), TOPO)
    assert len(ranks) == count == len(set(ranks))


def test_node_kinds_pick_from_nodes() -> None:
    topo = topology(nnodes=5, nproc=2)
    ranks, nodes = resolve(parse_spec("kill-node:mode=fixed:2,seed=1"), topo)
    assert ranks == ()
    assert len(nodes) == 2 and set(nodes) <= set(range(5))


@pytest.mark.parametrize("mode", ["one", "fixed:3", "percent:50"])
def test_same_seed_same_choice(mode: str) -> None:
    spec = parse_spec(f"kill-rank:mode={mode},seed=42")
    first = resolve(spec, TOPO)
    for _ in range(5):
        assert resolve(spec, TOPO) == first
        assert resolve(parse_spec(f"kill-rank:mode={mode},seed=42"), TOPO) == first


@pytest.mark.parametrize("mode", ["one", "fixed:3", "percent:50"])
def test_different_seeds_eventually_differ(mode: str) -> None:
    choices = {resolve(parse_spec(f"kill-rank:mode={mode},seed={seed}"), TOPO)[0] for seed in range(50)}
    assert len(choices) > 1


def test_seeded_choice_covers_the_pool() -> None:
    picked = {resolve(parse_spec(f"kill-rank:mode=one,seed={seed}"), TOPO)[0][0] for seed in range(200)}
    assert picked == set(ALL_RANKS)


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


def test_unknown_kind_names_it_and_lists_the_known_ones() -> None:
    message = spec_error("kill-everything:rank=1")
    assert "'kill-everything'" in message
    for kind in FaultKind:
        assert kind.value in message


def test_empty_kind() -> None:
    assert "''" in spec_error(":rank=1")


@pytest.mark.parametrize("key", ["rnak", "steps", "Rank", "durration"])
def test_unknown_key(key: str) -> None:
    message = spec_error(f"kill-rank:{key}=1,step=3")
    assert repr(key) in message


@pytest.mark.parametrize("field", ["rank=", "rank", "step=", "duration="])
def test_missing_value(field: str) -> None:
    message = spec_error(f"kill-rank:{field},t=4")
    assert repr(field) in message


def test_missing_key() -> None:
    assert "kill-rank:=1" in spec_error("kill-rank:=1")


def test_both_step_and_t() -> None:
    message = spec_error("kill-rank:rank=1,step=25,t=30")
    assert "step=" in message and "t=" in message


@pytest.mark.parametrize(
    ("text", "names"),
    [
        ("kill-rank:rank=1,node=0", ("rank", "node")),
        ("kill-node:node=1,host=host1", ("node", "host")),
        ("kill-rank:rank=1,mode=all", ("rank", "mode")),
    ],
)
def test_two_targets(text: str, names: tuple[str, str]) -> None:
    message = spec_error(text)
    assert text in message
    for name in names:
        assert name in message


@pytest.mark.parametrize(
    ("text", "bad"),
    [
        ("kill-rank:rank=one", "rank='one'"),
        ("kill-rank:rank=-1", "rank='-1'"),
        ("kill-rank:rank=1,step=2.5", "step='2.5'"),
        ("kill-rank:rank=1,t=soon", "t='soon'"),
        ("kill-rank:rank=1,t=-3", "t='-3'"),
        ("hang-rank:rank=1,duration=-1", "duration='-1'"),
        ("kill-rank:mode=one,seed=x", "seed='x'"),
    ],
)
def test_bad_numbers(text: str, bad: str) -> None:
    assert bad in spec_error(text)


@pytest.mark.parametrize(
    ("mode", "bad"),
    [
        ("some", "'some'"),
        ("fixed", "'fixed'"),
        ("one:2", "'one:2'"),
        ("fixed:two", "fixed='two'"),
        ("percent:0", "percent:0"),
        ("percent:101", "percent:101"),
    ],
)
def test_bad_modes(mode: str, bad: str) -> None:
    assert bad in spec_error(f"kill-rank:mode={mode}")


def test_rank_that_does_not_exist() -> None:
    message = resolve_error("kill-rank:rank=8")
    assert "rank 8" in message
    assert "8" in message  # world size


def test_node_that_does_not_exist() -> None:
    message = resolve_error("kill-node:node=2")
    assert "node 2" in message
    assert "node 5" in resolve_error("gpu-error:node=5")


def test_host_that_is_not_part_of_the_run() -> None:
    assert "'elsewhere'" in resolve_error("kill-node:host=elsewhere")


def test_fixed_larger_than_the_pool() -> None:
    message = resolve_error("kill-rank:mode=fixed:9,seed=1")
    assert "fixed:9" in message
    assert "8" in message
    # Node kinds draw from nodes: 3 is too many for 2 nodes although there are 8 ranks.
    assert "fixed:3" in resolve_error("kill-node:mode=fixed:3")


def test_errors_are_value_errors() -> None:
    """Callers that only know ValueError (config loaders, typer callbacks) still catch them."""
    with pytest.raises(ValueError):
        parse_spec("nope")


def test_spec_is_hashable_and_comparable() -> None:
    a = parse_spec("kill-rank:rank=1,step=25")
    b = parse_spec("kill-rank:step=25,rank=1")
    assert a == b
    assert len({a, b}) == 1
    assert isinstance(a, FaultSpec)


def test_the_kinds_that_break_the_job_are_those_only_a_recovery_ends() -> None:
    breaking = {k.value for k in FaultKind if k.breaks_job}
    assert breaking == {"kill-rank", "term-rank", "crash-rank", "kill-node", "reboot-node",
                        "gpu-error", "gpu-hang", "gpu-xid"}
    # Survivable: a hang that ends, a memory hog, every network fault.
    assert not any(FaultKind(k).breaks_job for k in ("hang-rank", "gpu-oom", "net-partition", "link-down"))
