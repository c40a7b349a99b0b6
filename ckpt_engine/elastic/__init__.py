"""Elastic fleets (issue 43 item 2): engines that join or restart mid-job pull the current version
from a serving peer with one-sided NIXL reads (`join.py`); the engine-side service lives in
`service.py`. Importing this package does not import NIXL."""

from ckpt_engine.elastic.join import PeerJoinError, PeerJoinReport, PeerJoinable, join_from_peer

__all__ = ["PeerJoinError", "PeerJoinReport", "PeerJoinable", "join_from_peer"]
