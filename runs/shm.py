"""The names a run gives its files in a host's shared memory, and how they are made safely.

Every file of a run lives in one private directory per run and host,
`/dev/shm/ffctl-<run>-<key>/` (`run_dir`): `key` is 128 random bits the controller draws for the
run, so no other user can create that name before the run does, and the directory is made with
mode 0700 and checked with lstat (a real directory, ours, 0700) before anything goes into it
(`ensure_private_dir`): whatever a stranger planted elsewhere in /dev/shm is never touched, and
nothing in it can be read by anyone else. Inside, files are still created with
O_CREAT|O_EXCL|O_NOFOLLOW and reopened with O_NOFOLLOW (`create_file`, `open_file`), and a file
that is not a regular file of ours is refused.

One owner for the naming contract between the processes that write, list, parse and remove them:
ranks write snapshot slots (`ffctl-<run>-n<node>-r<rank>-s<slot>`) and read in-step fault files
(`ffctl-<run>-fault-r<rank>.<8 characters>`, one file per fault; an agent's are
`ffctl-<run>-fault-n<node>.<8 characters>`); the agent claims its node's names with a lock file
(`ffctl-<run>-n<node>.lock`), lists, streams and wipes its slots, and keeps the FIFOs its forked
spares wait on in `ffctl-<run>-n<node>.spares/`; the fault planners write the fault files and
wipe a rebooted node's slots; the controller sweeps what a killed node left, and `ffctl inject
revert --all` removes the directories of runs no live process holds (`dead_run_dirs`).

Here, beside the run record, because `recovery` (the ranks and the agent's replicator) and
`fault_injectors` may both import `runs`, and neither may import the other. No torch.
"""
from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import shutil
import stat
from pathlib import Path

PREFIX = "ffctl-"
SHM_ROOT = "/dev/shm"  # where each run's private directory is made on a host
_KEY_HEX = 32  # 128 random bits: nobody can make the run's directory name before the run does
_RUN_DIR = re.compile(r"ffctl-([A-Za-z0-9][A-Za-z0-9._-]{0,127})-([0-9a-f]{%d})" % _KEY_HEX)
_OPEN = os.O_NOFOLLOW | os.O_CLOEXEC
_SLOT_TAIL = re.compile(r"r([0-9]{1,9})-s([0-9])")  # s0, s1 (and s2 under --verify-restore)
# After the run's fault prefix: one fault dropped for a rank or for a node's agent (the mailbox's
# name, then mktemp's eight letters and digits that make each fault a file of its own).
_MAIL_TAIL = re.compile(r"\.[A-Za-z0-9]{8}")
_FAULT_TAIL = re.compile(r"[rn]([0-9]{1,9})" + _MAIL_TAIL.pattern)


def node_prefix(run_id: str, node: int) -> str:
    """What every snapshot slot of a node starts with (not its claim lock, which ends `.lock`)."""
    return f"{PREFIX}{run_id}-n{node}-"


def slot_path(shm_dir: str, run_id: str, node: int, rank: int, slot: int) -> Path:
    return Path(shm_dir) / f"{node_prefix(run_id, node)}r{rank}-s{slot}"


def claim_path(shm_dir: str, run_id: str, node: int) -> Path:
    return Path(shm_dir) / f"{PREFIX}{run_id}-n{node}.lock"


def fault_prefix(run_id: str) -> str:
    return f"{PREFIX}{run_id}-fault-"


def fault_path(fault_dir: str, run_id: str, rank: int) -> str:
    """The mailbox in-step faults for `rank` are dropped in (`mailbox`; a string: it goes on a
    command line)."""
    return f"{fault_dir.rstrip('/') or ''}/{fault_prefix(run_id)}r{rank}"


def agent_fault_path(fault_dir: str, run_id: str, node: int) -> str:
    """The mailbox faults for node `node`'s agent are dropped in (corrupt-snapshot copy=replica:
    the replicas it holds); the agent looks in it at every turn of its loop."""
    return f"{fault_dir.rstrip('/') or ''}/{fault_prefix(run_id)}n{node}"


def mailbox(name: str | Path) -> list[Path]:
    """The faults dropped in the mailbox `name` (`fault_path`, `agent_fault_path`), oldest first.

    Each fault is a file of its own, `<name>.<8 letters and digits>`: with one file per mailbox,
    two faults for one rank close together overwrote each other (a straggler's end, reverted as
    a kill was armed, once took the kill's place, and the kill never landed). Oldest first by
    the time each was written (renaming keeps it), then by name; symlinks and anything else
    that is not a regular file are listed too, for the reader to refuse."""
    base = Path(name)
    found: list[tuple[int, str, Path]] = []
    try:
        with os.scandir(base.parent) as entries:
            for entry in entries:
                if not (entry.name.startswith(base.name) and _MAIL_TAIL.fullmatch(entry.name[len(base.name):])):
                    continue
                try:
                    written = entry.stat(follow_symlinks=False).st_mtime_ns
                except FileNotFoundError:
                    continue  # taken meanwhile
                found.append((written, entry.name, Path(entry.path)))
    except OSError:
        return []  # no directory (yet, or any more): no faults
    return [path for _, _, path in sorted(found)]


def parse_slot(name: str, run_id: str, node: int) -> tuple[int, int] | None:
    """(rank, slot) of a slot file name of this run and node; None for any other name.

    Matched whole after the node's prefix: a glob would also take the slots of another run whose
    id extends this one (`run` and `run-n0-r5`)."""
    prefix = node_prefix(run_id, node)
    if not name.startswith(prefix):
        return None
    m = _SLOT_TAIL.fullmatch(name[len(prefix):])
    return (int(m.group(1)), int(m.group(2))) if m else None


def slot_rank(path: Path | str, run_id: str, node: int) -> int:
    """The rank a slot file of this run and node belongs to (ValueError for any other name)."""
    parsed = parse_slot(Path(path).name, run_id, node)
    if parsed is None:
        raise ValueError(f"{Path(path).name!r} is not a snapshot slot of run {run_id!r}, node {node}")
    return parsed[0]


def node_slots(shm_dir: str, run_id: str, node: int) -> list[Path]:
    """The node's slot files that exist now, sorted."""
    prefix = node_prefix(run_id, node)
    try:
        return sorted(p for p in Path(shm_dir).glob(prefix + "r*-s*") if parse_slot(p.name, run_id, node))
    except OSError:
        return []


def fault_files(fault_dir: str, run_id: str) -> list[Path]:
    """The run's fault files that exist now (each a fault for a rank or an agent, until it
    takes it)."""
    prefix = fault_prefix(run_id)
    return sorted(p for p in Path(fault_dir).glob(prefix + "*") if _FAULT_TAIL.fullmatch(p.name[len(prefix):]))


def spare_dir(shm_dir: str, run_id: str, node: int) -> Path:
    """Where the node's agent keeps the FIFOs its forked spares wait on for their assignment."""
    return Path(shm_dir) / f"{PREFIX}{run_id}-n{node}.spares"


def sweep_node(shm_dir: str, run_id: str, node: int) -> int:
    """Remove the node's slots (and its spares' FIFOs); how many slots went. The caller holds
    the node's claim (or knows no live process writes them)."""
    gone = 0
    for path in node_slots(shm_dir, run_id, node):
        path.unlink(missing_ok=True)
        gone += 1
    shutil.rmtree(spare_dir(shm_dir, run_id, node), ignore_errors=True)
    return gone


def sweep_faults(fault_dir: str, run_id: str) -> int:
    """Remove the run's in-step fault files nobody read; how many went."""
    gone = 0
    for path in fault_files(fault_dir, run_id):
        path.unlink(missing_ok=True)
        gone += 1
    return gone


# -- the run's private directory ------------------------------------------------------------------
class UnsafeShm(OSError):
    """A shared-memory path is not what the run made (a symlink, a file or directory of another
    user, a FIFO, loose permissions): refused, never used. Its message names the path with the
    run's key left out (`redact`): the message is recorded and printed."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(code, redact(message))


_KEYED = re.compile(r"(%s[^/\s'\"]*?-)[0-9a-f]{%d}(?=[/\s'\"]|$)" % (re.escape(PREFIX), _KEY_HEX))


def redact(text: str) -> str:
    """`text` with each run directory's key replaced by `KEY`: the key keeps other users from
    making the directory's name first (a rebooted node makes it again), so it never goes into
    the world-readable record or a message."""
    return _KEYED.sub(r"\1KEY", text)


def run_dir(root: str, run_id: str, key: str) -> Path:
    return Path(root) / f"{PREFIX}{run_id}-{key}"


def new_run_dir(run_id: str, root: str = SHM_ROOT) -> str:
    """A fresh private directory name for a run (not made yet: each host's agent makes its own).

    No uid in the name: the same name serves every host of the run, whatever user runs it there;
    ownership is checked with lstat wherever it is used."""
    return str(run_dir(root, run_id, secrets.token_hex(_KEY_HEX // 2)))


def parse_run_dir(name: str) -> str | None:
    """The run id of a run directory's name; None for any other name."""
    m = _RUN_DIR.fullmatch(name)
    return m.group(1) if m else None


def check_private_dir(path: str | Path) -> None:
    """Raise UnsafeShm unless `path` itself (not a symlink's target) is a directory owned by us
    with mode 0700."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise UnsafeShm(errno.ENOENT, f"{path} does not exist") from None
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeShm(errno.ENOTDIR, f"{path} is not a directory (a symlink or a file another user may "
                                       "have planted): refusing to use it")
    if st.st_uid != os.geteuid():
        raise UnsafeShm(errno.EPERM, f"{path} belongs to uid {st.st_uid}, not to uid {os.geteuid()}: "
                                     "refusing to use it")
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise UnsafeShm(errno.EPERM, f"{path} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700: "
                                     "refusing to use it")


def ensure_private_dir(path: str | Path) -> Path:
    """Make the run's directory (mode 0700) unless an agent of another node on this host already
    did, then check it: a directory someone else made under this name is refused (UnsafeShm)."""
    p = Path(path)
    try:
        os.mkdir(p, 0o700)
    except FileExistsError:
        pass
    else:
        # mkdir's mode went through the umask: set it exactly, on the directory we just made
        # (through a descriptor that cannot follow a symlink put in its place).
        fd = os.open(p, os.O_RDONLY | os.O_DIRECTORY | _OPEN)
        try:
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    check_private_dir(p)
    return p


# -- files in it ------------------------------------------------------------------------------------
def create_file(path: str | Path, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """A descriptor of a file created now: never an existing file, never through a symlink
    (FileExistsError for both)."""
    return os.open(path, flags | os.O_CREAT | os.O_EXCL | _OPEN, mode)


def open_file(path: str | Path, flags: int = os.O_RDONLY) -> int:
    """A descriptor of an existing regular file of ours, opened without following a symlink
    (UnsafeShm for a symlink, a FIFO, a device or another user's file; FileNotFoundError)."""
    try:
        # O_NONBLOCK: opening a FIFO planted under the name would otherwise block here.
        fd = os.open(path, flags | os.O_NONBLOCK | _OPEN)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeShm(errno.ELOOP, f"{path} is a symlink: refusing to open it") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        os.close(fd)
        raise UnsafeShm(errno.EPERM, f"{path} is not a regular file of uid {os.geteuid()}: refusing to use it")
    os.set_blocking(fd, True)
    return fd


def open_or_create(path: str | Path, flags: int = os.O_RDWR, mode: int = 0o600) -> tuple[int, bool]:
    """(descriptor, created now) of a file of ours: opened if it exists, else created exclusively."""
    for _ in range(3):
        try:
            return open_file(path, flags), False
        except FileNotFoundError:
            pass
        try:
            return create_file(path, flags, mode), True
        except FileExistsError:
            continue  # made (or planted) meanwhile: look again
    raise UnsafeShm(errno.EEXIST, f"{path} keeps appearing and vanishing: refusing to use it")


def read_small(path: str | Path, limit: int = 4096) -> bytes:
    """At most `limit` bytes of a small file of ours (a fault file), read without following a
    symlink."""
    fd = open_file(path)
    try:
        return os.read(fd, limit)
    finally:
        os.close(fd)


# -- liveness and the dead runs' sweep ------------------------------------------------------------
def lock_free(path: Path) -> bool:
    """Whether no live process holds the lock file `path` (a claim ends when its holder dies)."""
    try:
        fd = open_file(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False  # not a lock of ours: leave the directory alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def hold(path: Path) -> int:
    """Hold the lock file `path` (made if missing) for the caller's life; the descriptor to keep.
    BlockingIOError when a live process holds it."""
    fd, _ = open_or_create(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def holder_path(shm_dir: str) -> Path:
    """The lock the launcher holds on a run directory of this host while the run lives (so that
    a sweep never takes the directory of a run between two of its agents)."""
    return Path(shm_dir) / f"{PREFIX}holder.lock"


def in_use(shm_dir: str | Path) -> bool:
    """Whether any live process (the launcher, an agent) holds one of the directory's locks."""
    try:
        locks = [p for p in Path(shm_dir).iterdir() if p.name.endswith(".lock")]
    except OSError:
        return True
    return not all(lock_free(p) for p in locks)


def live_twins(shm_dir: str, run_id: str, node: int) -> list[Path]:
    """Other directories of ours on this host for the same run id whose node `node` a live agent
    holds: another run given the same id."""
    here = Path(shm_dir)
    twins = []
    try:
        entries = list(here.parent.iterdir())
    except OSError:
        return []
    for path in entries:
        if path.name == here.name or parse_run_dir(path.name) != run_id:
            continue
        try:
            check_private_dir(path)
        except OSError:
            continue  # not ours: nothing of another user's counts
        if not lock_free(claim_path(str(path), run_id, node)):
            twins.append(path)
    return twins


def remove_run_dir(path: Path) -> int:
    """Remove a run directory of ours whole; how many snapshot slots it held."""
    run_id = parse_run_dir(path.name) or ""
    try:
        slots = sum(1 for p in path.iterdir() if _is_slot(p.name, run_id))
    except OSError:
        slots = 0
    shutil.rmtree(path, ignore_errors=True)
    return slots


def _is_slot(name: str, run_id: str) -> bool:
    prefix = f"{PREFIX}{run_id}-n"
    head, sep, tail = name[len(prefix):].partition("-") if name.startswith(prefix) else ("", "", "")
    return bool(sep) and head.isdigit() and _SLOT_TAIL.fullmatch(tail) is not None


def own_run_dirs(root: str = SHM_ROOT, run_id: str | None = None) -> list[Path]:
    """Run directories of ours under `root` (of `run_id` only, if given), live or not. Another
    user's entries, symlinks and anything not made as a run directory are never listed."""
    try:
        entries = sorted(Path(root).iterdir())
    except OSError:
        return []
    found = []
    for path in entries:
        rid = parse_run_dir(path.name)
        if rid is None or (run_id is not None and rid != run_id):
            continue
        try:
            check_private_dir(path)
        except OSError:
            continue
        found.append(path)
    return found


def dead_run_dirs(root: str = SHM_ROOT, run_id: str | None = None) -> list[Path]:
    """`own_run_dirs` that no live process holds: what a controller or agents killed with
    SIGKILL left."""
    return [path for path in own_run_dirs(root, run_id) if not in_use(path)]
