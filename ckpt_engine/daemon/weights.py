"""The daemon's `checkpoint_engine.weights` check: full weights or LoRA adapters, everywhere alike.

A daemon configured `weights: adapters` takes only engines that install adapter versions, and
syncs only sources that send one adapter in PEFT's layout (and the reverse for `full`); a trainer
following a standalone daemon must be configured like it. Each mismatch is refused by name with
the fix, before an engine is probed, paused or sent a byte.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ckpt_engine.control.wire import WireError
from ckpt_engine.daemon.adapters import close_quietly
from ckpt_engine.sync.weights_mode import check_weights_mode

if TYPE_CHECKING:
    from ckpt_engine.daemon.client import DaemonClient
    from ckpt_engine.rollout_adapters.base import RolloutAdapter
    from ckpt_engine.sources.base import WeightSource

logger = logging.getLogger(__name__)

__all__ = ["check_engine_weights", "check_sync_weights", "weights_refusal"]


def weights_refusal(name: str, described: str, engine_weights: str, mode: str) -> str:
    """Why an engine that takes `engine_weights` cannot join a daemon that syncs `mode`."""
    takes = "adapter syncs (LoRA versions)" if engine_weights == "adapters" else "full weights"
    return (
        f"engine {name!r} ({described}) takes {takes} but this daemon syncs checkpoint_engine.weights={mode!r}; "
        f"register an engine of the other kind, or run the daemon with checkpoint_engine.weights={engine_weights!r}"
    )


def check_engine_weights(name: str, described: str, adapter: RolloutAdapter, mode: str, owned: bool) -> None:
    """Refuse (ValueError) an engine whose weights mode is not `mode`; closes the adapter if `owned`."""
    if adapter.capabilities.weights == mode:
        return
    if owned:
        close_quietly(adapter)
    raise ValueError(weights_refusal(name, described, adapter.capabilities.weights, mode))


def check_sync_weights(mode: str, source: WeightSource, rollouts: Sequence[RolloutAdapter], upstream: DaemonClient | None) -> None:
    """Raise ValueError when the standalone daemon, the source or an engine does not match `mode`."""
    theirs = mode
    if upstream is not None:
        try:
            theirs = upstream.hello().get("weights", "full")
        except WireError as exc:  # a daemon that is down: sync the engines this trainer knows, as without the check
            logger.info("weights check skipped: the daemon at %s did not answer (%s)", upstream.address, exc)
        if theirs != mode:
            raise ValueError(
                f"the daemon at {upstream.address} syncs checkpoint_engine.weights={theirs!r} but this trainer's config "
                f"says {mode!r}; set checkpoint_engine.weights to match"
            )
    check_weights_mode(mode, list(source.metadata()), rollouts)
