"""The trainer ranks other than 0 in a multi-sender sync: join the group, send their own pieces.

Trainer rank 0 (the controller) talks to the engines and announces each sync over the trainer's
process group (`SenderChannel`): first whether to (re)join a weight-sync group and with which
options, then whether to send, which plan (by digest: every rank plans locally from the same
metadata and ownership, a pure function) and which delta request. Every rank reports its
outcome in one all-gather, so all ranks learn of a failure together. A rank whose source does
not send (`sends` false: a Megatron TP helper) joins no group but walks its sender's TP gathers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import CheckpointEngine, Rendezvous, SendStats
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.registry import CheckpointEngineRegistry
from ckpt_engine.sync.installed_shares import sender_shares
from ckpt_engine.sync.region_follower import FollowerRegions
from ckpt_engine.sync.sender_channel import SenderChannel
from ckpt_engine.sources.sharded import ShardedWeightSource, iter_pieces, piece_names

__all__ = ["SEND_FIGURES", "SenderFollower", "SendFailed", "finish_walk", "join_message", "send_figures", "send_message"]

logger = logging.getLogger(__name__)


class SendFailed(RuntimeError):
    """A sending trainer rank failed (this one, or another: every rank learns of it)."""


def join_message(rendezvous: Rendezvous | None, options: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "join", "rdzv": rendezvous.to_dict() if rendezvous is not None else None, "options": options}


def send_message(
    action: str, digest: str = "", delta: DeltaRequest | None = None, regions: dict[str, Any] | None = None,
    installed: dict[str, Any] | None = None, error: str | None = None,
) -> dict[str, Any]:
    """`regions`: region delivery's layout and digest (`RegionDelivery.announcement`), or None;
    `installed`: this sync's installed-weight check (`InstalledChecks.announcement`), or None;
    `error`: with "skip", why trainer rank 0's sync failed before the send (None: it ended without
    one, e.g. a daemon attempt that never started), so every rank raises it, not rank 0 alone."""
    return {
        "kind": "send", "action": action, "digest": digest, "delta": delta.to_dict() if delta is not None else None, "regions": regions,
        "installed": installed, "error": error,
    }


SEND_FIGURES = ("bytes", "wire_bytes", "dense_bytes", "changed_fraction")
"""What each sending rank reports of its send, so the controller's report counts every sender."""


def send_figures(stats: SendStats) -> dict[str, float]:
    """A send's figures for the report round: its bytes and, for a delta sync, its wire and dense
    bytes and changed fraction."""
    figures = {"bytes": float(stats.bytes)}
    figures.update({k: float(stats.extra[k]) for k in SEND_FIGURES[1:] if k in stats.extra})
    return figures


def _expect(msg: dict[str, Any], kind: str, keys: set[str]) -> dict[str, Any]:
    if msg.get("kind") != kind or set(msg) != keys:
        raise ValueError(f"unexpected message from trainer rank 0 (wanted {kind!r} with {sorted(keys)}): {msg!r:.200}")
    return msg


def _announced(channel: SenderChannel, kind: str, keys: set[str]) -> dict[str, Any]:
    """Trainer rank 0's next announcement; a failure to get it names rank 0 (it died or hung)."""
    try:
        msg = channel.receive()
    except RuntimeError as exc:
        raise SendFailed(
            f"trainer rank {channel.rank}: trainer rank 0 (the controller) sent no {kind!r} announcement within "
            f"{channel.timeout_s:g}s: it died or hung ({exc})"
        ) from exc
    return _expect(msg, kind, keys)


def finish_walk(source: ShardedWeightSource, pieces: Iterator[Any]) -> None:
    """After a failed send: walk the rest of a sender's pieces when producing them is collective
    with its TP helpers (`collective_pieces`), so none is left waiting in a gather."""
    if not source.collective_pieces:
        return
    try:
        for _ in pieces:
            pass
    except Exception as exc:  # the send's own error is the one to report
        logger.warning("finishing the pieces' walk after a failed send: %s", exc)


class SenderFollower:
    """One per trainer process of rank > 0; kept across syncs (the group is reused).

    A TP helper (`source.sends` false: same `sender_index` as its sender) never joins the group:
    it keeps an engine of the announced options only to plan alike, checks the digest, walks the
    sender's pieces in step (`assist_piece`) and reports in the same rounds as every other rank.
    Sources with TP helpers (`collective_pieces`) add a ready round before anything streams: one
    rank that cannot take part (its join, plan or digest) stops every rank, by name, before a
    sender or a helper waits in a gather and before the receivers wait for a sender."""

    def __init__(self, channel: SenderChannel) -> None:
        self.channel = channel
        self.engine: CheckpointEngine | None = None
        self.joined = False
        self._regions = FollowerRegions()
        self.figures: dict[str, float] | None = None
        """This rank's last send figures (`send_figures`), reported to trainer rank 0 in the report round."""

    def _join(self, msg: dict[str, Any], sender_index: int, sends: bool) -> None:
        if msg["rdzv"] is None:
            return
        self.close()
        opts = msg["options"]
        if not isinstance(opts, dict) or not {"bucket_size_bytes", "num_buffers", "verify", "engine_kwargs"} <= set(opts):
            raise ValueError(f"malformed join options from trainer rank 0: {opts!r:.200}")
        rdzv = Rendezvous.from_dict(msg["rdzv"])

        def new_engine() -> CheckpointEngine:  # this group's, and one per receiver set in region delivery
            return CheckpointEngineRegistry.new(
                rdzv.backend, bucket_size_bytes=opts["bucket_size_bytes"], num_buffers=opts["num_buffers"],
                timeout_s=rdzv.timeout_s, verify=opts["verify"], **opts["engine_kwargs"],
            )

        engine = new_engine()
        if sends:
            engine.init_process_group(rdzv, sender_index)
        self.engine, self.joined = engine, sends
        self._regions.joined(rdzv, new_engine, engine)

    def sync(self, source: ShardedWeightSource) -> None:
        """Collective with trainer rank 0's sync: follow its two announcements, send, report."""
        sends = source.sends
        join = _announced(self.channel, "join", {"kind", "rdzv", "options"})
        error: str | None = None
        try:
            self._join(join, source.sender_index, sends)
        except Exception as exc:
            error = f"join failed: {type(exc).__name__}: {exc}"
            logger.warning("trainer rank %d: %s", self.channel.rank, error)
        msg = _announced(self.channel, "send", {"kind", "action", "digest", "delta", "regions", "installed", "error"})
        if msg["action"] != "send":
            if msg["error"] is not None:  # rank 0 failed before the send: this rank's caller fails with it, in step
                own = f"; this rank's {error}" if error is not None else ""
                raise SendFailed(
                    f"trainer rank {self.channel.rank}: trainer rank 0 (the controller) failed this sync before the send: {str(msg['error']):.2000}{own}"
                )
            return
        manifest = None
        if error is None:
            manifest, error = self._plan(source, msg)
        if source.collective_pieces:  # TP helpers: every rank ready, or none walks
            if any(e is not None for e in self.channel.gather_status(error)):
                manifest = None
        self.figures = None
        if manifest is not None:
            if msg["regions"] is not None and sends:
                error, stats = self._regions.send(source, manifest, msg)
                self.figures = send_figures(stats) if stats is not None else None
            else:
                error = self._send(source, manifest, msg) if sends else self._assist(source, manifest)
        try:
            errors = self.channel.gather_status(error, self.figures if error is None else None)
        except RuntimeError as exc:  # rank 0 gathers last: the report round fails when it (or a sender) died
            raise SendFailed(
                f"trainer rank {self.channel.rank}: the report round after the send failed: trainer rank 0 (the controller) "
                f"or another sending rank died or hung ({exc}); this rank's send: {error or 'ok'}"
            ) from exc
        failed = {i: e for i, e in enumerate(errors) if e is not None}
        if msg["installed"] is not None and not failed:  # every rank sent: the installed-check round
            self._shares(source, manifest, msg["installed"])
        if failed:
            raise SendFailed("; ".join(f"trainer rank {i}: {e}" for i, e in sorted(failed.items())))

    def _shares(self, source: ShardedWeightSource, manifest: BucketManifest | None, announced: Any) -> None:
        """This rank's installed-check shares (`sender_shares`; none from a TP helper) to rank 0."""
        count = len(announced["keys"]) if isinstance(announced, dict) and isinstance(announced.get("keys"), list) else 0
        shares: list[int] | None = None
        try:
            shares = sender_shares(source, manifest, announced) if manifest is not None and source.sends else None
        except Exception as exc:  # the round still runs: every other rank waits in it
            logger.warning("trainer rank %d: folding its installed-check shares failed: %s", self.channel.rank, exc)
        try:
            self.channel.gather_shares(shares, count)
        except RuntimeError as exc:
            raise SendFailed(f"trainer rank {self.channel.rank}: the installed-check round failed: trainer rank 0 or another rank died or hung ({exc})") from exc

    def _plan(self, source: ShardedWeightSource, msg: dict[str, Any]) -> tuple[BucketManifest | None, str | None]:
        """This rank's plan of the sync, or why it has none (no engine, a failure, or a digest
        trainer rank 0 did not plan)."""
        engine = self.engine
        if engine is None:
            return None, "this rank is not in a weight-sync group (its join failed)"
        try:
            manifest = engine.plan(list(source.metadata()), num_senders=source.num_senders, owners=source.owners())
        except Exception as exc:
            logger.warning("trainer rank %d: planning its sync failed: %s", self.channel.rank, exc)
            self.close()
            return None, f"{type(exc).__name__}: {exc}"
        if manifest.digest != msg["digest"]:
            return None, f"planned {manifest.digest[:12]} but trainer rank 0 planned {str(msg['digest'])[:12]} (ranks disagree on metadata or ownership)"
        return manifest, None

    def _send(self, source: ShardedWeightSource, manifest: BucketManifest, msg: dict[str, Any]) -> str | None:
        engine = self.engine
        assert engine is not None
        pieces = iter_pieces(source, manifest)
        try:
            delta = DeltaRequest.from_dict(msg["delta"]) if msg["delta"] is not None else None
            stats = engine.send_weights(manifest, pieces, stable=source.stable_pieces, delta=delta)
            self.figures = send_figures(stats)
            return None
        except Exception as exc:
            logger.warning("trainer rank %d: sending its pieces failed: %s", self.channel.rank, exc)
            self.close()
            finish_walk(source, pieces)
            return f"{type(exc).__name__}: {exc}"

    def _assist(self, source: ShardedWeightSource, manifest: BucketManifest) -> str | None:
        """A TP helper's part of the send: its sender's gathers, in the order its pieces walk."""
        try:
            for name in piece_names(manifest, source.sender_index):
                source.assist_piece(name)
            return None
        except Exception as exc:
            logger.warning("trainer rank %d: walking sender %d's pieces failed: %s", self.channel.rank, source.sender_index, exc)
            return f"walking sender {source.sender_index}'s pieces as its TP helper failed: {type(exc).__name__}: {exc}"

    def close(self) -> None:
        self._regions.close()
        engine, self.engine, self.joined = self.engine, None, False
        if engine is not None:
            engine.finalize()
