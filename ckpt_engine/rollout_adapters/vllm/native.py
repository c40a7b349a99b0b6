"""vLLM's own weight-transfer API as `VllmRollout`'s channel: `WeightTransferChannel`.

The engine runs `--weight-transfer-config '{"backend": "ckpt_engine"}'` (no worker extension) and
the handle reaches it only through vLLM's weight-update calls of a client: ours (`vllm/clients.py`,
which also pause, resume, reset the prefix cache and read the weight version) or any
`VLLMWeightSyncClient` (then the caller pauses and resets caches itself, and nothing stages):

    VllmRollout("vllm", WeightTransferChannel(HTTPWeightSyncClient(url), num_workers=2))

`TransferRoute` maps each step of the handle onto those calls (the `update_weights` phases and what
the workers do in each: `vllm/transfer_engine.py`). vLLM returns nothing from its workers, so every
answer but "yes" is an error naming a marker (`vllm/answers.py`), and vLLM closes its weight update
after one: the route tracks whether an update is open and opens the next (validating again by
digest where a receive needs it). The workers' receive plans come back through the weight-sync
group's rendezvous store (each worker leaves its plan there at join), as staged outcomes and
installed-weight reports do (each worker leaves its report there in phase `installed`); their
budgets and health do not come back at all. Many senders need nothing of the route: every worker
reads the senders from the manifest.

On vLLM 0.26 (`vllm/compat.py`) the engine keeps no weight version: `finish_weight_update` takes
none, so every finalize has the workers stamp it (phase `install`) and the channel reads no version
(""); and with no `shutdown_weight_transfer_engine` the workers leave the group in an update of
their own (phase `leave`).
"""

from __future__ import annotations

import base64
import json
import logging
import sys
import time
from collections.abc import Callable, Hashable
from typing import Any, Protocol, runtime_checkable

from ckpt_engine.engine import Rendezvous
from ckpt_engine.installed import InstalledReport, InstalledRequest
from ckpt_engine.rollout_adapters.base import JoinOptions, ManifestRejectedError
from ckpt_engine.rollout_adapters.capabilities import Feature
from ckpt_engine.rollout_adapters.vllm.answers import NEED_MANIFEST, NO_ROOM, REJECTED, after, installed_key, plan_key, problems
from ckpt_engine.rollout_adapters.vllm.clients import EngineControl, HTTPWeightSyncClient, LLMWeightSyncClient
from ckpt_engine.rollout_adapters.vllm.compat import VllmFeatures, features_of
from ckpt_engine.rollout_adapters.vllm.routes import Route

__all__ = ["ReadsWeightVersion", "TransferRoute", "WeightTransferChannel"]

logger = logging.getLogger(__name__)

_NOT_CONFIGURED = "Weight transfer not configured"
"""What vLLM answers when the engine was started without a weight-transfer config."""
_UPDATE_ACTIVE = "while a weight update is already active"
"""What vLLM answers `start_weight_update` while an update is open: one that a trainer which died
mid-sync (its own handle, maybe its own process) never finished."""


@runtime_checkable
class ReadsWeightVersion(Protocol):
    """A client that reads the engine's weight version (vLLM's `/weight_info`), without the rest of
    `EngineControl`: enough for versions to carry on from what the engine holds."""

    def weight_version(self) -> str: ...


class _WeightInfo:
    """vLLM's `/weight_info` at `base_url`: the version of the server behind vLLM's plain
    `HTTPVLLMWeightSyncClient`, which has no call for it."""

    def __init__(self, base_url: str, timeout_s: float) -> None:
        self.base_url, self.timeout_s = base_url.rstrip("/"), timeout_s

    def weight_version(self) -> str:
        import requests

        resp = requests.get(f"{self.base_url}/weight_info", timeout=min(self.timeout_s, 10.0))
        resp.raise_for_status()
        return str(resp.json()["weight_version"])


class _SaysWhy:
    """vLLM's plain `HTTPVLLMWeightSyncClient` raises `HTTPError: 500 ...` and drops the server's
    answer, which says what was wrong and carries the words the route acts on (a rejected manifest,
    an update a dead trainer left open, the workers' count): the same calls, raising with the answer."""

    def __init__(self, plain: Any) -> None:
        self.plain = plain

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call(self.plain.init_weight_transfer_engine, init_info)

    def shutdown_weight_transfer_engine(self) -> None:
        self._call(self.plain.shutdown_weight_transfer_engine)

    def start_weight_update(self) -> None:
        self._call(self.plain.start_weight_update)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._call(self.plain.update_weights, update_info)

    def finish_weight_update(self, *version: str | None) -> None:
        self._call(self.plain.finish_weight_update, *version)

    @staticmethod
    def _call(call: Callable[..., None], *args: Any) -> None:
        import requests

        try:
            call(*args)
        except requests.HTTPError as exc:
            answer = exc.response.text[:2000] if exc.response is not None else ""
            raise RuntimeError(f"{exc}: {answer}") from exc


def _version_reader(client: Any) -> ReadsWeightVersion | None:
    """How the engine's version is read through `client`: its own call, or `/weight_info` for vLLM's
    plain HTTP client (recognised by class; vLLM is imported already if the client is one of its)."""
    if isinstance(client, ReadsWeightVersion):
        return client
    vllm_clients = sys.modules.get("vllm.distributed.weight_transfer.clients")
    if vllm_clients is not None and isinstance(client, vllm_clients.HTTPVLLMWeightSyncClient):
        return _WeightInfo(client.base_url, float(client.timeout))
    logger.warning(
        "%s cannot read the engine's weight version: versions carry on only within this process's sessions "
        "(give it a weight_version() -> str, e.g. ckpt_engine's HTTPWeightSyncClient)", type(client).__name__,
    )
    return None


class WeightTransferChannel:
    """The channel through vLLM's weight-transfer API over `client` (any `VLLMWeightSyncClient`) to
    an engine of `num_workers` worker ranks (tensor x pipeline x data parallel). The engine's
    control calls go to `client` when it offers them (`EngineControl`: both clients of
    `vllm/clients.py` do); without them pause, resume and the cache reset do nothing (the caller's).
    The engine's weight version is read wherever the client allows (`ReadsWeightVersion`, or
    `/weight_info` behind vLLM's plain `HTTPVLLMWeightSyncClient`): a new session, handle or client
    then counts on from what the engine holds, never back."""

    def __init__(self, client: Any, num_workers: int = 1) -> None:
        self.client = client
        self.num_workers = num_workers
        self.control: EngineControl | None = client if isinstance(client, EngineControl) else None
        self._ours = client if isinstance(client, (HTTPWeightSyncClient, LLMWeightSyncClient)) else None
        self._versions = _version_reader(client)
        if isinstance(self._versions, _WeightInfo):  # vLLM's plain HTTP client: its errors with the server's answer
            self.client = _SaysWhy(client)
        self.side_calls = self._ours is not None and self._ours.side_calls
        self.local = False  # the workers' pids are never known here

    def route(self, name: str, timeout_s: float, adapters: bool) -> TransferRoute:
        if not self.features.engine_weight_versions:
            logger.warning(
                "engine %s: vLLM %s keeps no engine weight version and its weight-transfer calls read none back from "
                "the workers: versions carry on only within this process's sessions", name, self.features.version,
            )
        return TransferRoute(self, name, adapters)

    @property
    def features(self) -> VllmFeatures:
        return self._ours.features if self._ours is not None else features_of()

    def pause(self, mode: str) -> None:
        if self.control is not None:
            self.control.pause(mode)

    def resume(self) -> None:
        if self.control is not None:
            self.control.resume()

    def pause_for_swap(self, mode: str) -> None:
        (self._ours.pause_for_swap if self._ours is not None else self.pause)(mode)

    def resume_after_swap(self) -> None:
        (self._ours.resume_after_swap if self._ours is not None else self.resume)()

    def reset_prefix_cache(self, running: bool = False) -> bool:
        return self.control.reset_prefix_cache(running) is not False if self.control is not None else True

    def weight_version(self) -> str:
        """The engine's version stamp ("" where the client cannot read it, or vLLM keeps none)."""
        return self._versions.weight_version() if self._versions is not None and self.features.engine_weight_versions else ""

    def set_weight_version(self, version: str) -> None:
        """Nothing: the route's `finish_weight_update(version)` stamps it (`TransferRoute`)."""

    def engine_key(self) -> Hashable:
        """The engine behind the client: its URL or `LLM` (else the client object)."""
        if self._ours is not None:
            return self._ours.engine_key()
        if isinstance(self._versions, _WeightInfo):  # vLLM's plain HTTP client: the server at its URL, as ours keys it
            return ("vllm-http", self._versions.base_url)
        return ("vllm-transfer", id(self.client))

    def world_size(self) -> int:
        return self.num_workers

    def health(self) -> None:
        """Raises when the engine does not answer (asked for its version where nothing else asks)."""
        if self._ours is not None:
            self._ours.health()
        elif self._versions is not None and self.features.engine_weight_versions:
            self._versions.weight_version()

    def close(self) -> None:
        """Nothing to close: the client is its caller's."""


class TransferRoute:
    """One handle's steps through vLLM's weight-update calls (module docstring); its swap and
    finalize stamp `version` on every worker (phases `swap`, `install`) and end with
    `finish_weight_update(version)`, which stamps the engine's: the two never differ."""

    def __init__(self, channel: WeightTransferChannel, name: str, adapters: bool) -> None:
        self.client, self.name, self.num_workers = channel.client, name, channel.num_workers
        self._channel = channel  # its vLLM release's features, read when a call differs between releases
        # Without control it cannot pause for a swap nor reset the cache. Installed-weight reports
        # come back through the group's store (an adapter join's too: vllm/lora_installed.py). vLLM's
        # own clients bound no call of theirs: the session's pool bounds the waits.
        lacks: tuple[Feature, ...] = ("checks_at_receive", "bounded_calls")
        self.lacks = frozenset(lacks if channel.control is not None else ("stages", "stages_regions", "pauses", *lacks))
        self.held: str | None = None  # the digest of the manifest every worker holds
        self._checked: tuple[str, bytes, list[bytes] | None] | None = None  # the last check (a receive may need it again)
        self._open = False  # a vLLM weight update is open (vLLM closes it when update_weights raises)
        self._adapters = adapters  # the workers take LoRA adapter versions (init info `weights: adapters`)
        self._joined: tuple[Rendezvous, int] | None = None  # the group and the workers' first rank in it
        self._plans: list[dict[str, Any]] | None = None

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions, adapters: int | None, preload: bool) -> list[int]:
        """`init_weight_transfer_engine` on every worker; an engine started without the
        weight-transfer config fails here at once, with the fix. (`preload`: vLLM drops every LoRA
        model when an update finishes, so the workers never preload one.)"""
        self.held, self._joined, self._plans = None, (rendezvous, rank_offset), None
        init = {"rendezvous": rendezvous.to_dict(), "rank_offset": rank_offset, "options": options.to_dict(), "num_workers": self.num_workers}
        if adapters is not None:
            init |= {"weights": "adapters", "max_adapter_versions": adapters}
        try:
            self.client.init_weight_transfer_engine(init)
        except Exception as exc:
            if _NOT_CONFIGURED not in str(exc):
                raise
            raise RuntimeError(
                f"engine {self.name!r} was started without a weight-transfer config ({exc}); start it with "
                "--weight-transfer-config '{\"backend\": \"ckpt_engine\"}' (or LLM(..., weight_transfer_config="
                "{\"backend\": \"ckpt_engine\"}))"
            ) from exc
        return []

    def check(self, digest: str, encoded: bytes, regions: list[bytes] | None, claim: dict[str, Any] | None = None) -> list[str]:
        """Open an update and have every worker check the manifest; it travels only when the
        workers may not hold it (first sync, new plan, or a worker that asks for it). No `claim`:
        this route has no peer calls, so nothing holds its engine (`vllm/holds.py`)."""
        assert claim is None, "the weight-transfer route takes no peer-lease claim"
        full = base64.b64encode(encoded).decode("ascii")
        send = None if self.held == digest else full
        assigned = {"regions": [base64.b64encode(a).decode("ascii") for a in regions]} if regions is not None else {}
        self._checked = (digest, encoded, regions)
        for attempt in range(2):
            self._start()
            try:
                self.client.update_weights({"phase": "validate", "digest": digest, "manifest": send, **assigned})
            except Exception as exc:  # vLLM closes the update when update_weights raises
                self._open = False
                text = str(exc)
                if attempt == 0 and send is None and NEED_MANIFEST in text:
                    send = full
                    continue
                self.held = None
                if REJECTED in text:
                    return problems(text)
                raise
            break
        self.held = digest
        return []

    def receive(self, digest: str, delta: dict[str, Any] | None, beside: Callable[[], None] | None = None) -> None:
        """vLLM's `update_weights` holds the engine core to its end: `beside` runs after it."""
        self._phase({"phase": "receive", "digest": digest, **({"delta": delta} if delta is not None else {})}, digest)
        if beside is not None:
            beside()

    def stage(self, digest: str, ticket: str, delta: dict[str, Any] | None, stage: str) -> None:
        """May start on some workers only (the others raised): the handle's discard clears them."""
        update = {"phase": "receive", "digest": digest, "stage": stage, "ticket": ticket}
        self._phase({**update, **({"delta": delta} if delta is not None else {})}, digest)

    def staged_reports(self) -> None:
        return None

    def swap(self, version: int) -> list[dict[str, Any]]:
        """The staged version in (and vLLM's post-load step), then the update closes with the stamp."""
        t0 = time.perf_counter()
        self._phase({"phase": "swap", "digest": self.held or "", "version": str(version)})
        load_s = time.perf_counter() - t0
        self._finish(str(version))
        return [{"load_s": load_s, "finalize_s": 0.0}]

    def finalize(self, version: int, release: str | None = None) -> list[dict[str, Any]]:
        """Layerwise post-processing and the stamps: every worker installs the received load as
        `version` (phase `install`; in an update of its own when an installed-weight check closed
        the receive's), then `finish_weight_update(version)` stamps the engine. Always both: vLLM's
        finish reaches the workers without the version, so a finish alone left the version the
        workers report at the previous one while the engine served the new one."""
        assert release is None, "the weight-transfer route takes no peer-lease claim"
        t0 = time.perf_counter()
        self._phase({"phase": "install", "digest": self.held or "", "version": str(version)})
        self._finish(str(version))
        return [{"finalize_s": time.perf_counter() - t0}]

    def discard(self) -> None:
        self._phase({"phase": "discard"})
        self._finish()

    def room(self, nbytes: int, limit_bytes: int | None) -> list[str]:
        """A "no" closes vLLM's update (the receive then validates again)."""
        try:
            self._phase({"phase": "room", "nbytes": int(nbytes), "limit_bytes": limit_bytes})
        except Exception as exc:
            if NO_ROOM not in str(exc):
                raise
            return [after(str(exc), NO_ROOM)]
        return []

    def leave(self) -> None:
        self.held = None
        if self._open:  # vLLM refuses to shut the transfer engine down inside an update
            self._finish()
        if self._channel.features.transfer_shutdown:
            self.client.shutdown_weight_transfer_engine()
        else:  # vLLM 0.26 has no such call: the workers leave in an update of their own
            self._phase({"phase": "leave"})
            self._finish()

    def plans(self) -> list[dict[str, Any]]:
        """What each worker left in the group's store at join (`answers.plan_key`), read once per join
        (the keys go then)."""
        if self._plans is None:
            if self._joined is None:
                raise RuntimeError(f"engine {self.name!r}: receive plans before join")
            rendezvous, first = self._joined
            store = rendezvous.connect_store(is_master=False)
            keys = [plan_key(first + i) for i in range(self.num_workers)]
            self._plans = [json.loads(store.get(key)) for key in keys]
            for key in keys:
                store.delete_key(key)
        return self._plans

    def budgets(self) -> list[dict[str, Any]]:
        raise NotImplementedError(f"engine {self.name!r}: vLLM's weight-transfer API returns no manifest budget")

    def health(self) -> None:
        return None

    def take_over(self, previous: Route) -> None:
        if isinstance(previous, TransferRoute):
            self.held, self._joined, self._plans = previous.held, previous._joined, previous._plans

    def arm_installed(self, request: InstalledRequest) -> None:
        """Before the stream, in the update the validate opened: every worker learns the check."""
        self._phase({"phase": "arm", "installed": request.to_wire()})

    def installed(self, request: InstalledRequest) -> list[InstalledReport]:
        """After the receive (in its update) or after a staged swap (which closed its update: one more
        opens for the report): every worker leaves its report in the group's store, read here once.
        Either way the update closes here, loading nothing and stamping nothing, before the session
        compares: a failed check must leave no vLLM update open (vLLM would refuse every other
        client's `start_weight_update`, and the engine's next sync would first finish this one). After
        a receive the workers hold the checked load (stale, unstamped) until `finalize` installs it."""
        if self._joined is None:
            raise RuntimeError(f"engine {self.name!r}: an installed-weight check before join")
        self._phase({"phase": "installed", "installed": request.to_wire()})
        self._finish()
        rendezvous, first = self._joined
        store = rendezvous.connect_store(is_master=False)
        keys = [installed_key(first + i, request.seed) for i in range(self.num_workers)]
        reports = [InstalledReport.from_wire(json.loads(store.get(key))) for key in keys]
        for key in keys:
            store.delete_key(key)
        return reports

    # --- vLLM's weight update: open at most one, know when vLLM closed it ---------------------------
    def _start(self) -> None:
        """Open a vLLM weight update (closing one left open, e.g. validated for a sync that another
        engine refused: nothing was loaded in it, so finishing it loads nothing)."""
        if self._open:
            self._finish()
        try:
            self.client.start_weight_update()
        except Exception as exc:
            if _UPDATE_ACTIVE not in str(exc):
                raise
            # A trainer died mid-sync and left its update open; vLLM would refuse every update from
            # now on. Nothing staged in it reached the live weights (the next receive drops it), and
            # a half-loaded unstaged one left the engine stale for a dense sync: close it, open ours.
            logger.warning("engine %s: closing a weight update that a trainer left open (it died mid-sync?)", self.name)
            self._finish()
            self.client.start_weight_update()
        self._open = True

    def _phase(self, update: dict[str, Any], checked: str | None = None) -> None:
        """One `update_weights` call in an open update. A receive of manifest `checked` must follow
        its validate in the same update: if vLLM closed that one ("no room" was an error), it
        validates again (by digest: the workers hold it)."""
        if checked is not None and not self._open:
            if self._checked is None or self._checked[0] != checked:
                raise RuntimeError(f"engine {self.name!r}: receive before validate; call validate() first")
            refused = self.check(*self._checked)
            if refused:
                raise ManifestRejectedError(self.name, refused)
        elif not self._open:
            self._start()
        try:
            self.client.update_weights(update)
        except BaseException:
            self._open = False  # vLLM ends its weight update when update_weights raises
            raise

    def _finish(self, version: str | None = None) -> None:
        """Close vLLM's update; `version` stamps the engine where vLLM keeps one (0.26 takes no
        argument: the workers were stamped in phase `install`)."""
        self._open = False
        if self._channel.features.engine_weight_versions:
            self.client.finish_weight_update(version)
        else:
            self.client.finish_weight_update()
