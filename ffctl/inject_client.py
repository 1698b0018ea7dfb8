"""Ad hoc injection into a running job: `ffctl inject` asks the run's controller to apply a fault.

The controller stays the only writer of the record, so the request goes through its store (the
endpoint is in run.json) and the controller answers under `inject/reply/<id>`.
"""
from __future__ import annotations

import json
import secrets
import time
from typing import Any

from ffctl.errors import BadInput, InfraError
from recovery import control
from runs.events import RunStatus
from runs.store import RunStore


def request(record: RunStore, spec_text: str, dry_run: bool, timeout: float = 30.0) -> dict[str, Any]:
    if record.status() is not RunStatus.RUNNING:
        raise BadInput(f"run {record.run_id!r} is not running (status {record.status().value})")
    ctl = record.read_json("run.json").get("controller")
    if not ctl:
        raise BadInput(f"run {record.run_id!r} has no controller endpoint yet")
    try:
        store = control.connect(ctl["address"], int(ctl["port"]), timeout=5.0)
    except Exception:
        raise InfraError(f"controller of run {record.run_id!r} at {ctl['address']}:{ctl['port']} is unreachable") from None
    req = secrets.token_hex(8)
    control.send(store, control.CTL_QUEUE, {"type": "inject_request", "spec": spec_text, "req": req, "dry_run": dry_run})
    key = f"inject/reply/{req}"
    deadline = time.monotonic() + timeout
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise InfraError(f"controller of run {record.run_id!r} did not answer within {timeout:g}s")
        time.sleep(0.02)
    reply: dict[str, Any] = json.loads(store.get(key))
    store.delete_key(key)
    if not reply.get("ok") and reply.get("bad_input"):
        raise BadInput(str(reply.get("error")))
    return reply
