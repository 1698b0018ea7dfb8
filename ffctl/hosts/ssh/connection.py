"""Opening an SSH connection the way OpenSSH does, and the errors that can come of it.

`resolve_settings` applies ``~/.ssh/config`` to a hostfile entry (HostName, User, Port,
IdentityFile, IdentitiesOnly, UserKnownHostsFile; the hostfile's user and port win);
`open_client` connects with the SSH agent and the default key files, and checks the host key
against known_hosts: an unknown host key is refused unless the caller asked to accept new keys
(then it is appended, the file otherwise untouched), a changed key is always refused. Every
failure is an `SSHError` (a `TransportError`) whose message is one line starting with the host it
is about. `ffctl.hosts.ssh.remote.SSHTransport` holds one such connection per host.
"""
from __future__ import annotations

import base64
import errno
import getpass
import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path

import paramiko

from fault_injectors.transport import TransportError
from ffctl.hosts.hostfile import HostEntry


# --------------------------------------------------------------------------------------------
# errors


class SSHError(TransportError):
    """An SSH failure; ``str()`` is one line that starts with the host (``node1: ...``)."""

    def __init__(self, host: str, problem: str) -> None:
        self.host = host
        self.problem = problem
        super().__init__(f"{host}: {problem}")


class HostUnreachable(SSHError):
    """No SSH server could be reached: DNS failure, refused, no route, timeout, connection lost."""


class HostKeyUnknown(SSHError):
    """The host's key is not in known_hosts and accepting new keys was not asked for."""


class HostKeyChanged(SSHError):
    """The host presented a key other than the one known_hosts holds for it (always refused)."""


class AuthFailed(SSHError):
    """The server refused every key offered (agent, IdentityFile, default key files)."""


# --------------------------------------------------------------------------------------------
# settings


@dataclass(frozen=True)
class SSHSettings:
    """Where and how to connect, after applying ssh_config to a hostfile entry."""

    alias: str  # the name from the hostfile, used in every message
    hostname: str
    port: int
    user: str
    identity_files: tuple[str, ...]
    identities_only: bool
    known_hosts: Path

    @property
    def label(self) -> str:
        """``node1`` or ``node1 (10.0.0.2:2222)`` when config maps the alias elsewhere."""
        if self.hostname == self.alias and self.port == 22:
            return self.alias
        return f"{self.alias} ({self.hostname}:{self.port})"


def default_ssh_config_path() -> Path:
    return Path(os.path.expanduser("~/.ssh/config"))


def resolve_settings(
    entry: HostEntry, *, ssh_config: str | Path | None = None, known_hosts: str | Path | None = None
) -> SSHSettings:
    """Apply ssh_config to ``entry`` the way ``ssh`` does: the hostfile's user and port win.

    ``ssh_config`` None means ``~/.ssh/config`` when it exists; ``known_hosts`` None means the
    config's UserKnownHostsFile, else ``~/.ssh/known_hosts``.
    """
    config_path = Path(ssh_config) if ssh_config is not None else default_ssh_config_path()
    options: dict[str, object] = {}
    if config_path.is_file():
        try:
            options = dict(paramiko.SSHConfig.from_path(str(config_path)).lookup(entry.name))
        except (OSError, paramiko.SSHException, ValueError) as exc:
            raise SSHError(entry.name, f"cannot read ssh config {config_path}: {exc}") from None

    hostname = str(options.get("hostname") or entry.name)
    try:
        port = entry.port if entry.port is not None else int(str(options.get("port", 22)))
    except ValueError:
        raise SSHError(entry.name, f"bad Port {options.get('port')!r} in {config_path}") from None
    user = entry.user or str(options.get("user") or "") or getpass.getuser()

    identity = options.get("identityfile") or []
    # paramiko gives a list (IdentityFile may be repeated); a lone value is taken as one file.
    identity_files = tuple(os.path.expanduser(str(p)) for p in (identity if isinstance(identity, list) else [identity]))
    identities_only = str(options.get("identitiesonly", "no")).lower() == "yes"

    if known_hosts is not None:
        kh = Path(known_hosts)
    elif options.get("userknownhostsfile"):
        # OpenSSH allows several files here; new keys go to the first, as ssh does.
        kh = Path(os.path.expanduser(str(options["userknownhostsfile"]).split()[0]))
    else:
        kh = Path(os.path.expanduser("~/.ssh/known_hosts"))
    return SSHSettings(entry.name, hostname, port, user, identity_files, identities_only, kh)


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH-style ``SHA256:...`` fingerprint, so users can compare with ``ssh-keygen -l``."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _append_known_host(path: Path, hostname: str, key: paramiko.PKey) -> None:
    # Appending (rather than paramiko's save_host_keys, which rewrites the whole file) keeps the
    # user's comments, markers and hashed entries intact.
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "r+b") as fh:
        size = fh.seek(0, os.SEEK_END)
        prefix = b""
        if size:
            fh.seek(size - 1)
            if fh.read(1) != b"\n":
                prefix = b"\n"
        fh.write(prefix + f"{hostname} {key.get_name()} {key.get_base64()}\n".encode())


def _load_known_hosts(keys: paramiko.HostKeys, path: Path) -> None:
    """Add a known_hosts file's keys, skipping lines paramiko cannot parse, as ssh does.

    (paramiko's own loader gives up on the whole file at the first such line; markers such as
    @cert-authority, key types it does not know and stray text all count.)
    """
    if not path.is_file():
        return
    for line_no, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith(("#", "@")):
            continue
        try:
            entry = paramiko.hostkeys.HostKeyEntry.from_line(line, line_no)
        except (paramiko.hostkeys.InvalidHostKey, paramiko.SSHException, ValueError):
            continue
        if entry is None or entry.key is None:
            continue
        for name in entry.hostnames:
            keys.add(name, entry.key.get_name(), entry.key)


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Called by paramiko only for hosts with no known key (a changed key never gets here)."""

    def __init__(self, label: str, known_hosts: Path, accept_new: bool) -> None:
        self.label = label
        self.known_hosts = known_hosts
        self.accept_new = accept_new

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey) -> None:
        if not self.accept_new:
            raise HostKeyUnknown(
                self.label,
                f"unknown host key ({key.get_name()} {fingerprint(key)}, not in "
                f"{self.known_hosts}); verify it, then rerun with --accept-new-host-keys",
            )
        client.get_host_keys().add(hostname, key.get_name(), key)
        try:
            _append_known_host(self.known_hosts, hostname, key)
        except OSError as exc:
            raise SSHError(self.label, f"cannot save host key to {self.known_hosts}: {exc}") from None


# --------------------------------------------------------------------------------------------
# connecting


def open_client(s: SSHSettings, *, accept_new: bool, connect_timeout: float, keepalive_s: float,
                system_known_hosts: bool) -> paramiko.SSHClient:
    """A connected, authenticated client for `s`, its host key checked against known_hosts
    (and /etc/ssh/ssh_known_hosts where `system_known_hosts`); every failure an `SSHError`."""
    client = paramiko.SSHClient()
    files = [s.known_hosts]
    if system_known_hosts:
        files.append(Path("/etc/ssh/ssh_known_hosts"))
    try:
        for path in files:
            _load_known_hosts(client.get_host_keys(), path)
    except OSError as exc:
        client.close()
        raise SSHError(s.label, f"cannot read known_hosts {exc.filename}: {exc.strerror}") from None
    client.set_missing_host_key_policy(
        _HostKeyPolicy(s.label, s.known_hosts, accept_new)
    )
    sock = _open_socket(s, connect_timeout)
    try:
        client.connect(
            s.hostname,
            port=s.port,
            username=s.user,
            sock=sock,
            key_filename=[p for p in s.identity_files if os.path.exists(p)] or None,
            allow_agent=True,
            look_for_keys=not s.identities_only,
            timeout=connect_timeout,
            banner_timeout=connect_timeout,
            auth_timeout=connect_timeout,
            channel_timeout=connect_timeout,
        )
    except BaseException as exc:
        client.close()
        sock.close()
        if not isinstance(exc, Exception):
            raise  # KeyboardInterrupt and friends pass through untouched
        raise _connect_error(s, exc, connect_timeout) from None
    transport = client.get_transport()
    if transport is not None and keepalive_s > 0:
        transport.set_keepalive(max(1, int(keepalive_s)))
    return client

def _open_socket(s: SSHSettings, connect_timeout: float) -> socket.socket:
    where = f"{s.hostname}:{s.port}"
    try:
        return socket.create_connection((s.hostname, s.port), timeout=connect_timeout)
    except socket.gaierror as exc:
        raise HostUnreachable(s.label, f"cannot resolve {s.hostname!r}: {exc.strerror}") from None
    except ConnectionRefusedError:
        raise HostUnreachable(s.label, f"connection refused on {where} (is sshd running?)") from None
    except (socket.timeout, TimeoutError):
        raise HostUnreachable(
            s.label, f"no answer from {where} within {connect_timeout:g}s"
        ) from None
    except OSError as exc:
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, str(exc))
        raise HostUnreachable(s.label, f"cannot connect to {where}: {reason}") from None

def _connect_error(s: SSHSettings, exc: Exception, connect_timeout: float) -> Exception:
    """What a failed `client.connect` means, as the `SSHError` a user can act on."""
    label = s.label
    if isinstance(exc, SSHError):
        return exc  # raised by our host key policy
    if isinstance(exc, paramiko.BadHostKeyException):
        return HostKeyChanged(
            label,
            f"HOST KEY CHANGED: it now offers {exc.key.get_name()} {fingerprint(exc.key)} but "
            f"{s.known_hosts} has {fingerprint(exc.expected_key)}; refusing "
            "(if the host was reinstalled, remove the old line from known_hosts)",
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return AuthFailed(
            label,
            f"authentication failed for user {s.user!r} "
            "(no key from the agent, IdentityFile or ~/.ssh was accepted)",
        )
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return HostUnreachable(label, f"SSH handshake timed out after {connect_timeout:g}s")
    if isinstance(exc, (EOFError, OSError)):
        return HostUnreachable(label, f"connection closed during SSH handshake: {exc or 'EOF'}")
    if isinstance(exc, paramiko.SSHException):
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "banner" in text.lower():
            return HostUnreachable(label, f"no SSH server answered: {text}")
        return SSHError(label, f"SSH failed: {text}")
    return exc
