"""Hostfile parsing: every accepted form, and one clear line for every kind of mistake."""
from __future__ import annotations

from pathlib import Path

import pytest

from ffctl.hosts.hostfile import HostEntry, HostfileError, parse_hostfile, parse_hostfile_text


def test_every_form() -> None:
    text = """\
# cluster A
node0
node1 slots=8
alice@node2
alice@node3:2222
bob@node4:22 slots=2   # trailing comment

10.1.2.3
[fd00::5]:2200
carol@[fd00::6]
node0:2201
"""
    assert parse_hostfile_text(text, "hosts") == [
        HostEntry("node0", None, None, None, 2),
        HostEntry("node1", None, None, 8, 3),
        HostEntry("node2", "alice", None, None, 4),
        HostEntry("node3", "alice", 2222, None, 5),
        HostEntry("node4", "bob", 22, 2, 6),
        HostEntry("10.1.2.3", None, None, None, 8),
        HostEntry("fd00::5", None, 2200, None, 9),
        HostEntry("fd00::6", "carol", None, None, 10),
        HostEntry("node0", None, 2201, None, 11),
    ]


def test_target_round_trips() -> None:
    entries = parse_hostfile_text("a@h:2\nh2\n[fd00::1]:7\n", "x")
    assert [e.target for e in entries] == ["a@h:2", "h2", "[fd00::1]:7"]
    assert str(entries[0]) == "a@h:2"


def test_entry_is_frozen() -> None:
    entry = HostEntry("h")
    with pytest.raises(AttributeError):
        entry.name = "other"  # type: ignore[misc]


def test_alias_like_names_are_accepted() -> None:
    entries = parse_hostfile_text("gpu_box-1.lab\nnode0\n", "x")
    assert [e.name for e in entries] == ["gpu_box-1.lab", "node0"]


def test_crlf_and_tabs() -> None:
    entries = parse_hostfile_text("node0\tslots=2\r\nnode1\r\n", "x")
    assert entries == [HostEntry("node0", slots=2, line_no=1), HostEntry("node1", line_no=2)]


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("node1:99999", "bad port '99999'"),
        ("node1:0", "bad port '0'"),
        ("node1:ssh", "bad port 'ssh'"),
        ("node1:", "bad port ''"),
        ("node1:²", "bad port '²'"),
        ("node1 slots=0", "bad slots '0'"),
        ("node1 slots=-1", "bad slots '-1'"),
        ("node1 slots=four", "bad slots 'four'"),
        ("node1 slots=", "bad slots ''"),
        ("node1 gpus=4", "unknown key 'gpus'"),
        ("node1 slots=1 slots=2", "'slots' given twice"),
        ("my node", "unexpected 'node'"),
        ("node;rm", "bad host name 'node;rm'"),
        ("$(touch x)", "bad host name '$(touch'"),
        ("`id`", "bad host name '`id`'"),
        ("a|b", "bad host name 'a|b'"),
        ("a&b", "bad host name 'a&b'"),
        ("a'b", "bad host name \"a'b\""),
        ("-oProxyCommand=x", "bad host name '-oProxyCommand=x'"),
        ("@node1", "bad user name ''"),
        ("ev;il@node1", "bad user name 'ev;il'"),
        ("user@", "bad host name ''"),
        ("[fd00::1", "unclosed '['"),
        ("[zz]:22", "bad IPv6 address 'zz'"),
        ("[fd00::1]x", "unexpected 'x' after ']'"),
        ("[fd00::1]:70000", "bad port '70000'"),
    ],
)
def test_errors_name_file_line_and_value(line: str, needle: str) -> None:
    text = f"# header\n\nok-host\n{line}\n"
    with pytest.raises(HostfileError) as info:
        parse_hostfile_text(text, "hosts.txt")
    message = str(info.value)
    assert message.startswith("hosts.txt:4: "), message
    assert needle in message, message
    assert "\n" not in message


def test_duplicate_host_names_both_lines() -> None:
    with pytest.raises(HostfileError) as info:
        parse_hostfile_text("node1\nnode2\nroot@NODE1 slots=2\n", "hosts.txt")
    message = str(info.value)
    assert message.startswith("hosts.txt:3: duplicate host 'root@NODE1'")
    assert "line 1" in message


def test_same_name_on_two_ports_is_not_a_duplicate() -> None:
    assert len(parse_hostfile_text("node1:2201\nnode1:2202\n", "x")) == 2


@pytest.mark.parametrize("text", ["", "\n\n", "# only\n   # comments\n"])
def test_empty_hostfile(text: str) -> None:
    with pytest.raises(HostfileError, match=r"^hosts.txt: no hosts"):
        parse_hostfile_text(text, "hosts.txt")


def test_parse_hostfile_reads_a_path(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("node0 slots=2\nroot@node1:2222\n")
    assert parse_hostfile(path) == [
        HostEntry("node0", slots=2, line_no=1),
        HostEntry("node1", "root", 2222, None, 2),
    ]


def test_error_from_a_path_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("node0\nnode1:http\n")
    with pytest.raises(HostfileError, match=rf"^{path}:2: bad port 'http'"):
        parse_hostfile(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(HostfileError, match="hostfile not found"):
        parse_hostfile(tmp_path / "nope")


def test_binary_file(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(HostfileError, match="not UTF-8"):
        parse_hostfile(path)
