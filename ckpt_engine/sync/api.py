"""sync_rollout_weights(): the one library call, and the sessions it keeps per set of engines.

Every trainer rank calls it. The controller rank (trainer rank 0, or the only sender) drives a
`WeightSyncSession` (see `session.py`); with many senders the other ranks follow its
announcements and send their own pieces; with one sender they only walk `iter_weights()`.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ckpt_engine.config import CheckpointEngineConfig, config_from_mapping
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.sync.report import SOURCE, SyncError, SyncReport
from ckpt_engine.sync.sender_channel import SenderChannel
from ckpt_engine.sync.sender_follower import SenderFollower
from ckpt_engine.sync.many_senders import ManySenders, refuse_to_followers, wants_many_senders
from ckpt_engine.sync.session import WeightSyncSession
from ckpt_engine.sources.vllm import as_weight_source
from ckpt_engine.sources.base import WeightSource, drain
from ckpt_engine.sources.fp8 import fp8_wire

__all__ = ["SOURCE", "SyncError", "SyncReport", "WeightSyncSession", "cached_session", "close_sessions", "sync_rollout_weights"]

_sessions: dict[tuple[Hashable, ...], WeightSyncSession] = {}
_sessions_lock = threading.Lock()


_followers: dict[int, SenderFollower] = {}


def _follower(source: WeightSource, config: CheckpointEngineConfig | None) -> SenderFollower:
    """This process's follower for the trainer group the source belongs to (kept across syncs)."""
    group = source.process_group
    follower = _followers.get(id(group))
    if follower is None:
        timeout = config.timeout_s if config is not None else CheckpointEngineConfig().timeout_s
        follower = _followers[id(group)] = SenderFollower(SenderChannel(group, timeout_s=timeout))
    return follower


def close_sessions() -> None:
    """Close every session `sync_rollout_weights` created (engines leave their groups), and
    every follower's group on the other trainer ranks."""
    with _sessions_lock:
        sessions = list(_sessions.values())
        _sessions.clear()
    for session in sessions:
        session.close()
    for follower in list(_followers.values()):
        follower.close()
    _followers.clear()


atexit.register(close_sessions)


def cached_session(rollouts: Sequence[RolloutAdapter], config: CheckpointEngineConfig | None) -> WeightSyncSession:
    """The session `sync_rollout_weights` keeps for these engines.

    Keyed by the engines themselves (`engine_key`), never by the handle objects: new handles on
    the same engines (same names) take over the session (`rebind`), so its group, plan and delta
    bases carry on. A new config closes the old session (its engines leave its group, its threads
    end) before a new one is made, and so does any cached session sharing an engine with this
    list. Versions carry on from what the engines hold.
    """
    key = tuple(r.engine_key() for r in rollouts)
    with _sessions_lock:
        session = _sessions.get(key)
        same = (
            session is not None
            and not session.closed
            and [r.name for r in session.rollouts] == [r.name for r in rollouts]
            and (config is None or session.config == config)
        )
        if session is not None and same:
            if any(a is not b for a, b in zip(session.rollouts, rollouts)):
                try:
                    session.rebind(rollouts)
                except RuntimeError:  # closed or busy meanwhile: a new session below
                    pass
                else:
                    return session
            else:
                return session
        # A session on any of these engines, or on an engine of the same name (an `LLM` replaced
        # under the trainer, a server moved): closed, and the new one counts on from its version,
        # so versions never go back even when the new engines hold none.
        wanted, names = set(key), {r.name for r in rollouts}
        older = [k for k, s in _sessions.items() if k == key or wanted.intersection(k) or names.intersection(r.name for r in s.rollouts)]
        floor, completed = 0, list[int]()
        for old_key in older:
            old = _sessions.pop(old_key)
            floor = max(floor, old.version)
            completed += [old.completed] if old.completed is not None else []
            old.close()
        session = _sessions[key] = WeightSyncSession(rollouts, config)
        session.version = floor  # and what it completed is not stamped again, on other weights, as a "catch-up"
        session.completed = max(completed, default=None)
        return session


def sync_rollout_weights(
    source: WeightSource,
    rollouts: Sequence[RolloutAdapter] | WeightSyncSession | None,
    *,
    version: int | None = None,
    config: CheckpointEngineConfig | Mapping[str, Any] | None = None,
) -> SyncReport | None:
    """Push one version of `source`'s weights into every rollout engine.

    Call it on every trainer rank: ranks whose source is not the sender (`source.is_sender` false)
    only walk `iter_weights()` (its gathers are collectives) and return None. On the sender,
    `rollouts` is a list of engine adapters (a session is kept per set of engines and reused) or
    a session. Concurrent calls for the same engines run one at a time. `config` may also be the
    `checkpoint_engine` section as a mapping (a verl / Hydra config node).
    """
    if isinstance(config, Mapping):
        config = config_from_mapping(CheckpointEngineConfig, {"checkpoint_engine": config}, "checkpoint_engine")
    source = as_weight_source(source)  # a vLLM `WeightSource` works as well (sources/vllm.py)
    if not source.is_sender:
        mode = config.senders if config is not None else "auto"
        if wants_many_senders(source, mode):
            wire = fp8_wire(source, config.wire_dtype if config is not None else None)
            _follower(source, config).sync(wire)  # type: ignore[arg-type]  # wants_many_senders: sharded
        else:
            drain(source)
        return None
    many = wants_many_senders(source, config.senders if config is not None else "auto")
    runs = ManySenders.runs
    try:
        return _send(source, rollouts, version, config)
    except BaseException as exc:
        if many and ManySenders.runs == runs:  # refused before the other ranks heard of this sync: tell them
            timeout = config.timeout_s if config is not None else CheckpointEngineConfig().timeout_s
            refuse_to_followers(source, timeout, f"trainer rank 0: {type(exc).__name__}: {exc}")
        raise


def _send(
    source: WeightSource, rollouts: Sequence[RolloutAdapter] | WeightSyncSession | None, version: int | None,
    config: CheckpointEngineConfig | None,
) -> SyncReport:
    """The sending rank's part of `sync_rollout_weights`."""
    if rollouts is None:
        raise ValueError("the sending trainer rank must pass the rollout engines (or a WeightSyncSession)")
    if isinstance(rollouts, WeightSyncSession):
        return rollouts.sync(source, version=version)
    rollouts = list(rollouts)  # read more than once below: a generator would be spent by the first
    report = cached_session(rollouts, config)._locked_sync(source, version, drain_if_closed=False)
    if report is not None:
        return report
    # A concurrent call with another config closed that session between the lookup and its lock:
    # its replacement takes this sync (and a source it cannot take is drained, as on every failure).
    return cached_session(rollouts, config).sync(source, version=version)
