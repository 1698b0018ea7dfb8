"""Ad hoc injection into a running job: `ffctl inject` asks the run's controller to apply a fault.

The controller stays the only writer of the record, so the request goes through its store (the
endpoint is in run.json) and the controller answers, an `InjectReply`, under a key of the
request's own (`messages.inject_reply_key`). Both are sealed
with the job token, read from the run's owner-only token file: the controller ignores a request
anyone else wrote, and this client a reply it did not seal.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from ffctl.exits import BadInput, InfraError
from wire import control, messages, storeclient
from wire.fault_spec import FaultSpec
from runs.events import RunStatus
from runs.store import RunStore, RunStoreError


def request(record: RunStore, fault: FaultSpec, dry_run: bool, timeout: float = 30.0) -> messages.InjectReply:
    """Ask the run's controller to inject `fault` (or with `dry_run` to plan it); its answer.
    BadInput when the run cannot take it or the controller found the spec wrong for the job,
    InfraError when the controller cannot be reached or does not answer in `timeout` seconds."""
    return _ask(record, lambda req: messages.InjectRequest(fault=fault, req=req, dry_run=dry_run), timeout)


def revert(record: RunStore, fault_id: str, dry_run: bool, timeout: float = 30.0) -> messages.InjectReply:
    """Ask the run's controller to revert its fault `fault_id` now (with `dry_run`: whether it
    could); raises as `request` does (BadInput: no such fault, or nothing to revert)."""
    return _ask(record, lambda req: messages.RevertRequest(fault_id=fault_id, req=req, dry_run=dry_run), timeout)


def _ask(record: RunStore, build: Callable[[str], messages.Message], timeout: float) -> messages.InjectReply:
    """Send the request `build` makes for a fresh request id, sealed; the controller's answer."""
    if record.status() is not RunStatus.RUNNING:
        raise BadInput(f"run {record.run_id!r} is not running (status {record.status().value})")
    ctl = record.read_json("run.json").get("controller")
    if not ctl:
        raise BadInput(f"run {record.run_id!r} has no controller endpoint yet")
    try:
        store = storeclient.connect(ctl["address"], int(ctl["port"]), timeout=5.0)
    except Exception:
        raise InfraError(f"controller of run {record.run_id!r} at {ctl['address']}:{ctl['port']} is unreachable") from None
    try:
        token = record.token()
    except RunStoreError as exc:
        raise BadInput(str(exc)) from None
    sealer, opener = control.Sealer(token, "inject"), control.Opener(token)
    req = secrets.token_hex(8)
    blocked = control.send(store, control.CTL_QUEUE, build(req), sealer)
    if blocked is not None:
        raise InfraError(f"controller of run {record.run_id!r}: request not sent ({blocked.reason})")
    key = messages.inject_reply_key(req)
    deadline = time.monotonic() + timeout
    refused = ""
    while True:
        raw = control.read(store, key)  # never blocks, whoever deletes the key meanwhile
        if raw is not None:
            try:
                reply = messages.InjectReply.from_dict(opener.open(raw, key, replay=False))
                if reply.req == req:
                    break
                refused = f"an answer to request {reply.req!r}"
            except control.Rejected as exc:
                refused = exc.reason  # not the controller's: wait for its own answer
            except messages.DecodeError as exc:
                refused = exc.reason
        if time.monotonic() > deadline:
            why = f" (a forged or malformed answer was refused: {refused})" if refused else ""
            raise InfraError(f"controller of run {record.run_id!r} did not answer within {timeout:g}s{why}")
        time.sleep(0.02)
    store.delete_key(key)
    if not reply.ok and reply.bad_input:
        raise BadInput(str(reply.error))
    return reply
