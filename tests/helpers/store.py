"""A TCPStore server on a loopback port of its own, for tests of the control plane."""
from __future__ import annotations

import datetime
import socket

import torch.distributed as dist

_SOCKETS: list[socket.socket] = []  # the listening sockets must outlive their stores


def loopback_store() -> dist.TCPStore:
    # Bound here, on loopback only, as the controller does (torch would listen on every interface).
    sock = socket.socket()
    _SOCKETS.append(sock)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    return dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=5), master_listen_fd=sock.fileno())
