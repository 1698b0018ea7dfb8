"""How a rank ends on SIGTERM: at once, and within a bound even when it cannot unwind.

torchrun's workers die of SIGTERM (its default action). A rank that links the library unwinds
instead (SystemExit from the signal handler), so that its snapshot in flight is finished and its
slots are closed. Unwinding is not bounded by itself: Python runs the handler only when the main
thread is back in the interpreter (a store wait or a collective can keep it in C++ for a long
time), and interpreter shutdown with torch loaded takes a second on a busy host, more with a
process-group thread still waiting on a peer. A chaos soak saw SIGTERMed ranks take up to 7 s to
exit and some never did (the hang detector found them after 5 s): the controller sees a rank's
failure only when it exits.

So the signal is also watched off the main thread (`signal.set_wakeup_fd`: the C-level handler
writes its number to a socket whatever the main thread is doing), and `TERM_EXIT_S` after it the
process ends with `os._exit(128 + signum)` wherever it is. A slot left half-written is marked so
in its header, as after a SIGKILL, and never read. A rank that unwound to the end of `Job.run`
exits there the same way (`exit_now`), without the interpreter's teardown.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Any

TERM_EXIT_S = 1.0

_code: list[int] = []
_sockets: list[socket.socket] = []  # the wakeup pair, kept open for the life of the process


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass


def exit_now(code: int) -> None:
    """End the process now with `code`, its output flushed first."""
    _flush()
    os._exit(code)


def _arm(signum: int) -> None:
    """Start the bound on the rank's way out (once)."""
    if _code:
        return
    _code.append(128 + signum)

    def later() -> None:
        threading.Event().wait(TERM_EXIT_S)
        exit_now(128 + signum)

    threading.Thread(target=later, name="ffctl-term-bound", daemon=True).start()


def terminated() -> int | None:
    """The exit code a SIGTERM asked for, or None when none came."""
    return _code[0] if _code else None


def _on_term(signum: int, frame: Any) -> None:
    _arm(signum)
    raise SystemExit(128 + signum)


def _watch(sock: socket.socket) -> None:
    while True:
        try:
            data = sock.recv(64)
        except OSError:
            return
        if not data:
            return
        if signal.SIGTERM in data:
            _arm(signal.SIGTERM)


def install() -> None:
    """SIGTERM unwinds the main thread and ends the process within TERM_EXIT_S. From the main
    thread (as `signal.signal` must be)."""
    signal.signal(signal.SIGTERM, _on_term)
    if _sockets:
        return  # watched already (a second Job in this process)
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # not the main thread after all: the handler alone arms the bound
        reader.close()
        writer.close()
        return
    threading.Thread(target=_watch, args=(reader,), name="ffctl-term-watch", daemon=True).start()
    _sockets.extend((reader, writer))
    os.register_at_fork(after_in_child=_forget)


def _forget() -> None:
    # A child forked by the rank (a DataLoader worker) must not write its own SIGTERM into the
    # rank's socket: the rank would take it for its own and end.
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    for sock in _sockets:
        sock.close()
    _sockets.clear()


def release() -> None:
    """Training is over: SIGTERM is its default again (the agent stopping a rank still tearing
    down ends it as usual)."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
