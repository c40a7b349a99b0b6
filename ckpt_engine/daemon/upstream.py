"""A trainer's daemon following a standalone daemon (`ckpt-engine serve`): before each sync it
mirrors the standalone daemon's members, building adapters from their descriptors."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckpt_engine.control.wire import RpcError, WireError
from ckpt_engine.daemon.adapters import make_adapter
from ckpt_engine.daemon.membership import EngineRecord, Membership
from ckpt_engine.daemon.ownership import adopt
from ckpt_engine.daemon.versions import JobVersions
from ckpt_engine.versions import check_version

if TYPE_CHECKING:
    from ckpt_engine.daemon.client import DaemonClient

__all__ = ["mirror_upstream"]

logger = logging.getLogger(__name__)


def mirror_upstream(
    upstream: DaemonClient, membership: Membership, versions: JobVersions, drop: Callable[[EngineRecord, str], bool], timeout_s: float,
    set_group: Callable[[str | None], str],
) -> None:
    """Mirror the standalone daemon's members: adapters for new ones, remove departed ones; its
    version is adopted and its group name taken (`set_group`: the group to adopt new engines into)."""
    try:
        snap = upstream.members()
    except (OSError, WireError, RpcError) as exc:  # restarting: its engines re-register, the mirror follows
        logger.warning("the daemon at %s did not answer (%s); syncing the engines it listed last", upstream.address, exc)
        return
    versions.adopt(check_version(snap["version"], "the daemon's version"), "the daemon")
    group = set_group(snap.get("group"))
    remote = {e["name"]: e for e in snap["engines"]}
    for rec in membership.records():
        if rec.name not in remote or remote[rec.name]["engine"] != rec.engine:
            drop(rec, "left (per the daemon)")
    for name, e in remote.items():
        known = membership.get(name)
        if known is None:
            try:
                adapter = make_adapter(name, e["engine"], timeout_s, token=upstream.token)
            except ValueError as exc:
                logger.warning("skipping engine %s: %s", name, exc)
                continue
            adopt(adapter, group)
            known = EngineRecord(name=name, engine=dict(e["engine"]), adapter=adapter, owned=True)
            membership.add(known)
        known.state, known.version = e["state"], e["version"]
