"""The trainer ranks other than 0 in a multi-sender sync: join the group, send their own pieces.

Trainer rank 0 (the controller) talks to the engines and announces each sync over the trainer's
process group (`SenderChannel`): first whether to (re)join a weight-sync group and with which
options, then whether to send, which plan (by digest: every rank plans locally from the same
metadata and ownership, a pure function) and which delta request. Every sending rank reports
its outcome in one all-gather, so all ranks learn of a failure together.
"""

from __future__ import annotations

import logging
from typing import Any

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import CheckpointEngine, Rendezvous
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sender_channel import SenderChannel
from ckpt_engine.sharded_source import ShardedWeightSource, iter_pieces

__all__ = ["SenderFollower", "SendFailed", "join_message", "send_message"]

logger = logging.getLogger(__name__)


class SendFailed(RuntimeError):
    """A sending trainer rank failed (this one, or another: every rank learns of it)."""


def join_message(rendezvous: Rendezvous | None, options: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "join", "rdzv": rendezvous.to_dict() if rendezvous is not None else None, "options": options}


def send_message(action: str, digest: str = "", delta: DeltaRequest | None = None) -> dict[str, Any]:
    return {"kind": "send", "action": action, "digest": digest, "delta": delta.to_dict() if delta is not None else None}


def _expect(msg: dict[str, Any], kind: str, keys: set[str]) -> dict[str, Any]:
    if msg.get("kind") != kind or set(msg) != keys:
        raise ValueError(f"unexpected message from trainer rank 0 (wanted {kind!r} with {sorted(keys)}): {msg!r:.200}")
    return msg


class SenderFollower:
    """One per trainer process of rank > 0; kept across syncs (the group is reused)."""

    def __init__(self, channel: SenderChannel) -> None:
        self.channel = channel
        self.engine: CheckpointEngine | None = None

    def _join(self, msg: dict[str, Any], sender_index: int) -> None:
        if msg["rdzv"] is None:
            return
        self.close()
        opts = msg["options"]
        if not isinstance(opts, dict) or not {"bucket_size_bytes", "num_buffers", "verify", "engine_kwargs"} <= set(opts):
            raise ValueError(f"malformed join options from trainer rank 0: {opts!r:.200}")
        rdzv = Rendezvous.from_dict(msg["rdzv"])
        engine = CheckpointEngineRegistry.new(
            rdzv.backend, bucket_size_bytes=opts["bucket_size_bytes"], num_buffers=opts["num_buffers"],
            timeout_s=rdzv.timeout_s, verify=opts["verify"], **opts["engine_kwargs"],
        )
        engine.init_process_group(rdzv, sender_index)
        self.engine = engine

    def sync(self, source: ShardedWeightSource) -> None:
        """Collective with trainer rank 0's sync: follow its two announcements, send, report."""
        join = _expect(self.channel.receive(), "join", {"kind", "rdzv", "options"})
        error: str | None = None
        try:
            self._join(join, source.sender_index)
        except Exception as exc:
            error = f"join failed: {type(exc).__name__}: {exc}"
            logger.warning("trainer rank %d: %s", self.channel.rank, error)
        msg = _expect(self.channel.receive(), "send", {"kind", "action", "digest", "delta"})
        if msg["action"] != "send":
            return
        if error is None:
            error = self._send(source, msg)
        errors = self.channel.gather_status(error)
        failed = {i: e for i, e in enumerate(errors) if e is not None}
        if failed:
            raise SendFailed("; ".join(f"trainer rank {i}: {e}" for i, e in sorted(failed.items())))

    def _send(self, source: ShardedWeightSource, msg: dict[str, Any]) -> str | None:
        engine = self.engine
        if engine is None:
            return "this rank is not in a weight-sync group (its join failed)"
        try:
            manifest = engine.plan(list(source.metadata()), num_senders=source.num_senders, owners=source.owners())
            if manifest.digest != msg["digest"]:
                return f"planned {manifest.digest[:12]} but trainer rank 0 planned {str(msg['digest'])[:12]} (ranks disagree on metadata or ownership)"
            delta = DeltaRequest.from_dict(msg["delta"]) if msg["delta"] is not None else None
            engine.send_weights(manifest, iter_pieces(source, manifest), stable=bool(getattr(source, "stable_pieces", getattr(source, "stable_tensors", False))), delta=delta)
            return None
        except Exception as exc:
            logger.warning("trainer rank %d: sending its pieces failed: %s", self.channel.rank, exc)
            self.close()
            return f"{type(exc).__name__}: {exc}"

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.finalize()
