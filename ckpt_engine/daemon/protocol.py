"""The daemon's control protocol: msgpack frames over TCP, one request -> one reply.

Framing is `ckpt_engine.control.wire`'s: a 4-byte big-endian length, then a msgpack map (no extension
types, no pickle), served by `ckpt_engine.control.server` with the limits of the `daemon:` section
(handshake deadline, per-frame deadline, frame size, connection caps; see that module).

Request:  `{"id": int, "method": str, "params": {"token": str, ...}}`
Reply:    `{"id": int, "ok": true, "result": ...}` or `{"id": int, "ok": false, "error": {"type", "message"}}`

Every request carries the job's `token` (compared in constant time); a wrong or missing token is
refused with error type `AuthError`, so two daemons or jobs on one host never act on each other's
messages. Params are checked against the table below before any handler runs: a missing,
unknown or mistyped param is refused with `ProtocolError` and the daemon keeps serving.

| method        | params (besides token)                  | result                                              |
|---------------|-----------------------------------------|-----------------------------------------------------|
| `hello`       | -                                       | `{protocol, role, version, epoch, group}`           |
| `register`    | `name: str`, `engine: map`              | engine record; nothing is paused until a sync starts |
| `leave`       | `name: str`                             | `{left: bool}`                                      |
| `heartbeat`   | `name: str`                             | `{version, state}` (engine's target version)       |
| `members`     | -                                       | `{epoch, version, group, engines: [record, ...]}`   |
| `status`      | -                                       | members + departed engines, manifest, last sync    |
| `begin_sync`  | `version: int`                          | `{version}`; a trainer names the version it is about to sync (kept before any engine holds it) |
| `report_sync` | `outcome: map`                          | `{version}`; a trainer driving syncs for a standalone daemon |
| `shutdown`    | -                                       | `{}`; the daemon stops serving                      |

`engine` describes how to reach the engine: `{"kind": <registered engine kind>, ...kind params}`,
e.g. `{"kind": "torch_ref", "host": "127.0.0.1", "port": 40123}`. A record is
`{name, engine, state, version, last_seen_s, health}` with state one of `pending` (registered,
holds no complete version yet; not paused: it serves what it loaded until a sync covers it), `serving` (holds `version` completely and serves it),
`paused` (holds `version` completely but is paused: a sync stopped before moving data), `stale`
(a sync failed part-way: paused, holds no complete version, `version` is nil) or `joining` (pulling
the current version from a serving peer, `daemon.peer_join`: out of service, left out of syncs). Versions are ints
in [0, 2**63-1], never go down and never label two sets of weights; a daemon adopts the highest
version its engines hold, and a reported outcome may not jump more than 2**32 past it.

`group` names the job's weight-sync group (derived from the job token: the same for every daemon
of the job, a restarted one included). An engine belongs to one group at a time: the daemon claims
each engine it registers, and an engine claimed by another group refuses (see
`ckpt_engine.daemon.ownership`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from ckpt_engine.control.server import ProtocolError
from ckpt_engine.control.wire import AuthError
from ckpt_engine.versions import check_version

__all__ = [
    "AuthError",
    "PROTOCOL_VERSION",
    "ProtocolError",
    "SCHEMAS",
    "check_engine_descriptor",
    "check_engine_name",
    "check_outcome",
    "check_params",
]

PROTOCOL_VERSION = 1
MAX_NAME_LEN = 128
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:@/-]*$")


def check_engine_name(name: Any) -> str:
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN or not _NAME_RE.match(name):
        raise ProtocolError(
            f"engine name must be 1-{MAX_NAME_LEN} characters of letters, digits and _.:@/- (starting with a letter or digit), got {name!r:.80}"
        )
    return name


def check_engine_descriptor(engine: Any) -> dict[str, Any]:
    """Shape checks only; the kind's factory checks its own params."""
    if not isinstance(engine, dict) or not isinstance(engine.get("kind"), str) or not engine["kind"]:
        raise ProtocolError(f"engine must be a map with a string 'kind' (e.g. torch_ref), got {engine!r:.120}")
    if len(engine) > 32:
        raise ProtocolError(f"engine descriptor has {len(engine)} keys; at most 32")
    _check_plain(engine, "engine", depth=0)
    return dict(engine)


def _check_plain(value: Any, where: str, depth: int) -> None:
    """Reject deep nesting and non-finite floats in free-form maps (they end up in status output)."""
    if depth > 6:
        raise ProtocolError(f"{where} nests deeper than 6 levels")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ProtocolError(f"{where} has a non-string key {k!r:.40}")
            _check_plain(v, f"{where}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]", depth + 1)
    elif isinstance(value, float) and not math.isfinite(value):
        raise ProtocolError(f"{where} is not a finite number")
    elif value is not None and not isinstance(value, (str, int, float, bool, bytes)):
        raise ProtocolError(f"{where} has an unsupported type {type(value).__name__}")


def _version_or_none(value: Any, where: str) -> int | None:
    if value is None:
        return None
    try:
        return check_version(value, where)
    except ValueError as exc:
        raise ProtocolError(f"{exc} (or nil)") from None


def _version(value: Any) -> int:
    try:
        return check_version(value, "version")
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None


def check_outcome(outcome: Any) -> dict[str, Any]:
    """Validate a `report_sync` outcome (a SyncOutcome.to_dict() from a trainer)."""
    if not isinstance(outcome, dict):
        raise ProtocolError(f"outcome must be a map, got {type(outcome).__name__}")
    required = {"version": int, "ok": bool, "engines": dict, "states": dict, "dropped": dict, "stale": list}
    for key, typ in required.items():
        if key not in outcome:
            raise ProtocolError(f"outcome lacks {key!r}")
        if not isinstance(outcome[key], typ) or (typ is int and isinstance(outcome[key], bool)):
            raise ProtocolError(f"outcome.{key} must be {typ.__name__}, got {outcome[key]!r:.80}")
    try:
        check_version(outcome["version"], "outcome.version")
    except ValueError as exc:
        raise ProtocolError(str(exc)) from None
    for name, version in outcome["engines"].items():
        check_engine_name(name)
        _version_or_none(version, f"outcome.engines.{name}")
    for name, state in outcome["states"].items():
        check_engine_name(name)
        if state not in ("pending", "serving", "paused", "stale", "joining"):
            raise ProtocolError(f"outcome.states.{name} must be pending, serving, paused, stale or joining, got {state!r:.40}")
    for name, why in outcome["dropped"].items():
        check_engine_name(name)
        if not isinstance(why, str):
            raise ProtocolError(f"outcome.dropped.{name} must be a string reason")
    for name in outcome["stale"]:
        check_engine_name(name)
    descriptors = outcome.get("descriptors", {})
    if not isinstance(descriptors, dict) or not all(isinstance(d, dict) for d in descriptors.values()):
        raise ProtocolError(f"outcome.descriptors must map engine names to their descriptors, got {descriptors!r:.80}")
    for name in descriptors:
        check_engine_name(name)
    _check_plain(outcome, "outcome", depth=0)
    return outcome


_Check = Callable[[Any], Any]

SCHEMAS: dict[str, dict[str, _Check]] = {
    "hello": {},
    "register": {"name": check_engine_name, "engine": check_engine_descriptor},
    "leave": {"name": check_engine_name},
    "heartbeat": {"name": check_engine_name},
    "members": {},
    "status": {},
    "begin_sync": {"version": _version},
    "report_sync": {"outcome": check_outcome},
    "shutdown": {},
}


def check_params(method: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """Validated params of one request (token excluded) or ProtocolError naming the problem; the
    control server has checked that `method` is a str and `params` a map."""
    if method not in SCHEMAS:
        raise ProtocolError(f"unknown method {method!r:.60}; known: {', '.join(sorted(SCHEMAS))}")
    schema = SCHEMAS[method]
    given = set(params) - {"token"}
    missing = sorted(set(schema) - given)
    unknown = sorted(str(k)[:40] for k in given - set(schema))
    if missing or unknown:
        raise ProtocolError(
            f"{method}: " + "; ".join(
                part for part in (
                    f"missing param(s) {', '.join(missing)}" if missing else "",
                    f"unknown param(s) {', '.join(unknown)}" if unknown else "",
                ) if part
            ) + f"; expected: token{''.join(', ' + k for k in schema)}"
        )
    return {key: check(params[key]) for key, check in schema.items()}
