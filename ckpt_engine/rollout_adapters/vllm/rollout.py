"""vLLM through ckpt-engine's worker extension: one handle, `VllmRollout`, over a channel.

Start vLLM with `worker_extension_cls=WORKER_EXTENSION` (`vllm/worker.py`). The channel
(`vllm/clients.py`) carries every control call: an in-process `vllm.LLM` (`collective_rpc`, its
engine-core utilities) or a dev-mode `vllm serve` over HTTP (`VLLM_SERVER_DEV_MODE=1`:
`/collective_rpc`, `/pause`, `/resume`, `/sleep`, `/wake_up`, `/reset_prefix_cache`,
`/update_weight_version`, `/weight_info`; `VllmServerRollout` builds it from a URL). Weights go only
through the weight-sync group, into ranks `rank_offset + worker rank`.

One sync: validate (manifest checked against vLLM's own parameters after its stacking rules) ->
pause the scheduler -> receive (layerwise reload, bucket by bucket) -> finalize (layerwise
post-processing, prefix-cache reset, engine weight version stamped; vLLM then tags every
request's output tokens with it) -> resume.

A staged sync (`receive(..., stage=...)` then `swap`): the workers receive on a background thread
while the engine keeps generating (`vllm/staging.py`); the swap pauses the scheduler, loads the
staged version through layerwise reload in one `collective_rpc` (vLLM runs it between two engine
steps, on every worker) beside the cache reset and the version stamp, and resumes. vLLM's
`weight_versions` spans then show which tokens of a request came from which version.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.engine import Rendezvous
from ckpt_engine.manifest import BucketManifest, ManifestBudget
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.rollout_adapters.base import STAGES, JoinOptions, ManifestRejectedError, Membership, ReceiveReport, RolloutAdapter, version_of
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.vllm.clients import PAUSE_MODES, Channel, HTTPWeightSyncClient, LLMWeightSyncClient
from ckpt_engine.rollout_adapters.vllm.stage_outcome import StagedOutcomes

if TYPE_CHECKING:
    import vllm

__all__ = ["WORKER_EXTENSION", "VllmRollout", "VllmServerRollout", "http_channel"]

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "ckpt_engine.rollout_adapters.vllm.worker.CkptEngineWorkerExtension"


class VllmRollout(RolloutAdapter):
    """Handle on one vLLM engine started with `worker_extension_cls=WORKER_EXTENSION`, over a channel:
    an in-process `vllm.LLM` (`llm`, driven through `LLMWeightSyncClient`) or any `Channel`
    (`HTTPWeightSyncClient`: what `VllmServerRollout` builds from a URL).

    In process, call `sync` from a thread other than one generating with the same `LLM`: control
    calls go through `llm.collective_rpc`, which queues behind a running `generate`.
    """

    capabilities = EngineCapabilities(delta=True, many_senders=True, regions=True, stages=True, stages_regions=True)
    """Delta: each worker keeps a base copy, applies patches there, reloads full tensors. Regions:
    each worker states the regions its loaders read (`receive_plans`). Staged: workers receive on a
    background thread while the engine steps and `swap` loads; with receive plans each worker keeps
    its region items (only its slice bytes, checked against its plan as they land) and the swap
    assembles and loads them."""

    def __init__(
        self, name: str, llm: vllm.LLM | Channel, *, timeout_s: float = 300.0, staging_limit_bytes: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """`world_size`: the engine's worker count (asked of the channel when None)."""
        if staging_limit_bytes is not None and (isinstance(staging_limit_bytes, bool) or not isinstance(staging_limit_bytes, int) or staging_limit_bytes < 0):
            raise ValueError(f"engine {name!r}: staging_limit_bytes must be a non-negative int or None, got {staging_limit_bytes!r}")
        self.name = name
        self.timeout_s = timeout_s
        self.staging_limit_bytes = staging_limit_bytes
        self.pids: list[int] = []
        self._sent_digest: str | None = None
        self.version: int | None = None
        self.last_finalize: dict[str, Any] = {}
        self._pause_mode = "keep"
        self.staged = StagedOutcomes(name, timeout_s)  # staged receives report their end in the group's store
        self.client: Channel = llm if isinstance(llm, (HTTPWeightSyncClient, LLMWeightSyncClient)) else LLMWeightSyncClient(llm, timeout_s)
        self.world_size = world_size if world_size is not None else self.client.world_size()

    def engine_key(self) -> Hashable:
        return self.client.engine_key()

    def _rpc(self, method: str, timeout_s: float | None = None, **kwargs: Any) -> list[Any]:
        """`method` on every worker (the extension's `ckpt_*`), one result per worker."""
        try:
            return self.client.collective_rpc(method, kwargs, timeout_s if timeout_s is not None else self.timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"engine {self.name!r}: {exc}") from None
        except Exception as exc:
            clear = self._missing_extension(method, exc)
            if clear is exc:
                raise
            raise clear from exc

    def _missing_extension(self, method: str, exc: Exception) -> Exception:
        """A clearer error when vLLM says a `ckpt_*` worker method does not exist, else `exc`."""
        text = str(exc)  # vLLM's wording differs by path: worker getattr, or run_method
        if f"has no attribute '{method}'" not in text and f"Method {method!r} is not implemented" not in text:
            return exc
        return RuntimeError(
            f"engine {self.name!r}: vLLM was started without ckpt-engine's worker extension (its workers have no "
            f"{method!r}); start it with worker_extension_cls={WORKER_EXTENSION!r} (LLM(...) keyword, or "
            f"--worker-extension-cls {WORKER_EXTENSION} for `vllm serve`)"
        )

    def take_over(self, previous: RolloutAdapter) -> None:
        """A new handle on the same engine: the workers' pids, the manifest they hold, the group its
        staged receives report in."""
        if isinstance(previous, VllmRollout):
            self.pids, self._sent_digest, self.version = list(previous.pids), previous._sent_digest, previous.version
            self.staged.take_over(previous.staged)

    def held_version(self) -> int | None:
        """The version the engine's workers hold (the extension keeps it across adapter objects)."""
        return self.membership().version

    def membership(self) -> Membership:
        """One `ckpt_health` of every worker: the newest version any holds, and the group each
        joined; a worker whose pid is not the one that joined restarted (it is in no group)."""
        replies = self.worker_health()
        versions = {version_of(h.get("version")) for h in replies}
        if len(versions) > 1:
            logger.warning("engine %s: workers report different versions %s", self.name, sorted(map(str, versions)))
        groups = [h.get("group") if isinstance(h.get("group"), str) else None for h in replies]
        if self.pids and [h.get("pid") for h in replies] != self.pids:
            groups = [None] * len(replies)
        return Membership(max((v for v in versions if v is not None), default=None), groups)

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self._sent_digest = None
        self.staged.join(rendezvous, list(range(rank_offset, rank_offset + self.world_size)))
        results = self._rpc("ckpt_join", rendezvous=rendezvous.to_dict(), rank_offset=rank_offset, options=options.to_dict())
        self.pids = [int(r["pid"]) for r in results]

    def manifest_budget(self) -> ManifestBudget:
        """The most any of the engine's workers would decode (each worker's `ManifestBudget` from its
        own model and group): a process that decodes manifests for the engine sizes its decode by it."""
        replies = self._rpc("ckpt_manifest_budget")
        return ManifestBudget(**{k: max(int(r[k]) for r in replies) for k in ("tensors", "nbytes", "name_bytes", "ndim", "senders")})

    def receive_plans(self) -> list[ReceivePlan | None]:
        """Per worker rank, the regions it holds, recorded in each worker from vLLM's own loaders
        (None: that worker could not record one and receives whole tensors)."""
        plans: list[ReceivePlan | None] = []
        for rank, reply in enumerate(self._rpc("ckpt_receive_plan")):
            if reply.get("plan") is None:
                logger.warning("engine %s worker %d: no receive plan (%s); it receives whole tensors", self.name, rank, reply.get("error"))
                plans.append(None)
            else:
                plans.append(ReceivePlan.from_wire(reply["plan"]))
        return plans

    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        self._validate(manifest, encoded, {})

    def validate_regions(self, manifest: BucketManifest, encoded: bytes, assignments: list[bytes]) -> None:
        """`validate`, each worker also checking its region assignment against its recorded plan."""
        self._validate(manifest, encoded, {"regions": [self.client.encode(a) for a in assignments]})

    def _validate(self, manifest: BucketManifest, encoded: bytes, extra: dict[str, Any]) -> None:
        send = None if self._sent_digest == manifest.digest else self.client.encode(encoded)
        replies = self._rpc("ckpt_validate", encoded=send, digest=manifest.digest, **extra)
        if any(r.get("need_manifest") for r in replies):
            replies = self._rpc("ckpt_validate", encoded=self.client.encode(encoded), digest=manifest.digest, **extra)
        problems: list[str] = []
        for rank, reply in enumerate(replies):
            if not reply.get("accepted"):
                problems += [p if len(replies) == 1 else f"worker {rank}: {p}" for p in reply.get("problems") or ["rejected"]]
        if problems:
            self._sent_digest = None
            raise ManifestRejectedError(self.name, problems)
        self._sent_digest = manifest.digest

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None, *, stage: str | None = None) -> ReceiveReport:
        """Receive and load `manifest` (the engine paused), or with `stage` receive it into staging
        on the workers' background threads while the engine keeps generating (then `swap`). Both
        stages land alike here: a delta sync in the workers' checked base images, a dense one in
        their staging copy (`vllm/staging.py`)."""
        if stage is not None and stage not in STAGES:
            raise ValueError(f"engine {self.name!r}: stage must be one of {', '.join(STAGES)} or None, got {stage!r}")
        extra = {"delta": delta.to_dict()} if delta is not None else {}
        if stage is None:
            replies = self._rpc("ckpt_receive", timeout_s=self.timeout_s * 2, digest=manifest.digest, **extra)
        else:
            with self.staged.receiving() as ticket:  # from here a discard stops the wait
                self._rpc("ckpt_stage", digest=manifest.digest, ticket=ticket, **extra)
                outcomes = self.staged.wait(ticket)  # each worker reports its end in the group's store
            self.staged.check(outcomes, self.discard)
            replies = [r["report"] for r in self._rpc("ckpt_stage_status", timeout_s=min(self.timeout_s, 30.0))]
        reports = [ReceiveReport.from_dict(r) for r in replies]
        slowest = max(reports, key=lambda r: r.receive_s)
        return ReceiveReport(slowest.tensors, slowest.bytes, slowest.receive_s, max(r.load_s for r in reports), min(r.loaded for r in reports))

    def swap(self, version: int, pause_mode: str) -> float:
        """Between two engine steps: pause (per `pause_mode`; `none` pauses as `keep`), load the
        staged version on every worker, reset the prefix cache, stamp `version`, resume. Returns
        the seconds the engine produced nothing. A swap that fails part-way leaves the engine
        paused (its weights may be a mix: stale).

        Why `keep` pauses too: vLLM labels a step's tokens with the engine core's weight version,
        and the load (`collective_rpc`) and the stamp (`set_weight_version`) are two engine-core
        calls that no vLLM route joins; unpaused, a step between them is mislabelled
        (docs/staged-syncs.md). Paused, they run side by side where the channel allows (`side_calls`)."""
        mode = pause_mode if pause_mode != "none" else "keep"
        if mode not in PAUSE_MODES:
            raise ValueError(f"engine {self.name!r}: pause_mode must be one of {', '.join(PAUSE_MODES)} or none, got {pause_mode!r}")
        t0 = time.perf_counter()
        self._pause_for_swap(mode)
        t_paused = time.perf_counter()
        replies = self._load_and_stamp(version, mode)
        t1 = time.perf_counter()
        self.version = version
        self._resume_after_swap()
        stall = time.perf_counter() - t0
        self.last_finalize = {
            "post_process_s": max(float(r["finalize_s"]) for r in replies),
            "swap_load_s": max(float(r["load_s"]) for r in replies),
            "swap_shadow": all(bool(r.get("shadow", False)) for r in replies),  # every worker copied a prepared image
            "swap_shadow_layers": [int(r.get("shadow_layers", 0)) for r in replies],  # per worker: the layers it prepared
            "swap_shadow_bytes": [int(r.get("shadow_bytes", 0)) for r in replies],  # per worker: their tensors' bytes
            "shadow_build_s": max(float(r.get("shadow_build_s", 0.0)) for r in replies),  # on the staging thread, off the step path
            "swap_pause_s": t_paused - t0,
            "swap_rpc_s": t1 - t_paused,
            "stall_s": stall,
        }
        return stall

    def _load_and_stamp(self, version: int, mode: str) -> list[Any]:
        """With the engine paused: the load on every worker, the prefix-cache reset and the engine's
        version stamp; side by side when the channel's `side_calls`. If the load fails, the engine's stamp is
        put back to the version its weights were stamped with (best effort; the engine stays paused)."""
        def stamp() -> None:
            self._reset_prefix_cache(running=mode == "recompute")
            self._set_engine_version(str(version))

        if not self.client.side_calls:
            replies = self._rpc("ckpt_swap", version=version)
            stamp()
            return replies
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-swap-stamp") as side:
            stamped = side.submit(stamp)
            try:
                replies = self._rpc("ckpt_swap", version=version)
            except BaseException:
                if stamped.exception(timeout=self.timeout_s) is None and self.version is not None:
                    try:
                        self._set_engine_version(str(self.version))
                    except Exception as exc:  # the swap's own error is the one to raise
                        logger.warning("engine %s: could not restore the weight version after a failed swap: %s", self.name, exc)
                raise
            stamped.result(timeout=self.timeout_s)
        return replies

    # --- the engine, through the channel -------------------------------------------------------
    def pause(self, mode: str) -> None:
        self._pause_mode = mode
        if mode != "none":
            self.client.pause(mode)

    def resume(self) -> None:
        self.client.resume()

    def _pause_for_swap(self, mode: str) -> None:
        """Pause for a swap (`mode` keep/abort/recompute) by the channel's quickest route."""
        self._pause_mode = mode
        self.client.pause_for_swap(mode)

    def _resume_after_swap(self) -> None:
        self.client.resume_after_swap()

    def _reset_prefix_cache(self, running: bool = False) -> None:
        """Drop the prefix cache; `running`: also preempt running requests (they re-prefill)."""
        if not self.client.reset_prefix_cache(running):
            logger.warning("engine %s: prefix cache reset refused (blocks still held by in-flight requests)", self.name)

    def _set_engine_version(self, version: str) -> None:
        self.client.set_weight_version(version)

    def weight_version(self) -> str:
        if not self.client.features.engine_weight_versions:  # only the workers hold it (vllm/compat.py)
            return str(self.held_version())
        return self.client.weight_version()

    def health(self) -> dict[str, Any]:
        if self.client.local:
            self._check_pids()
        try:
            self.client.health()
        except RuntimeError as exc:
            raise RuntimeError(f"engine {self.name!r}: {exc}") from exc
        return {"pids": self.pids, "version": self.version}

    def close(self) -> None:
        self.client.close()

    def discard(self) -> None:
        """Drop a staged version on every worker; the live weights and version are untouched. A
        staged receive still waiting for the workers' outcomes on another thread stops waiting."""
        idle = self.staged.stop()
        try:
            self._rpc("ckpt_discard")
        finally:
            self.staged.clear(idle)

    def staging_room(self, nbytes: int) -> bool:
        """Whether every worker can hold a staging copy of `nbytes` (within `staging_limit_bytes`).
        With receive plans the session asks for the largest rank's slice bytes, which is what a
        worker's staging copy then holds (its region items, `vllm/staging.py`)."""
        replies = self._rpc("ckpt_staging_room", nbytes=int(nbytes), limit_bytes=self.staging_limit_bytes)
        short = [f"worker {rank}: {r['why']}" for rank, r in enumerate(replies) if not r.get("room")]
        if short:
            logger.info("engine %s: no room for a staging copy (%s)", self.name, "; ".join(short))
        return not short

    def finalize(self, version: int) -> None:
        t0 = time.perf_counter()
        replies = self._rpc("ckpt_finalize", version=version)
        t1 = time.perf_counter()
        self._reset_prefix_cache(running=self._pause_mode == "recompute")
        self._set_engine_version(str(version))
        self.version = version
        self.last_finalize = {
            "post_process_s": max(float(r["finalize_s"]) for r in replies),
            "finalize_rpc_s": t1 - t0,
            "cache_and_version_s": time.perf_counter() - t1,
        }

    def leave(self) -> None:
        self.staged.leave()  # a wait in flight lets go of the store before the group's store goes away
        self._rpc("ckpt_leave")

    def worker_health(self) -> list[dict[str, Any]]:
        """Per-worker state from the extension (not usable while a receive is in flight)."""
        return self._rpc("ckpt_health", timeout_s=min(self.timeout_s, 30.0))

    def _check_pids(self) -> None:
        for pid in self.pids:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                raise RuntimeError(f"engine {self.name!r}: worker process {pid} is gone") from None
            except PermissionError:
                pass
            if _is_zombie(pid):
                raise RuntimeError(f"engine {self.name!r}: worker process {pid} exited")


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


class VllmServerRollout(VllmRollout):
    """`VllmRollout` over the HTTP routes of `python -m vllm.entrypoints.openai.api_server
    --worker-extension-cls ...` in dev mode, at `base_url`. `session`: the `requests.Session` for
    the control calls; `world_size`: spares asking the server."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        timeout_s: float = 300.0,
        world_size: int | None = None,
        session: Any = None,
        staging_limit_bytes: int | None = None,
    ) -> None:
        client, workers = http_channel(name, base_url, timeout_s, session, world_size)
        super().__init__(name, client, timeout_s=timeout_s, staging_limit_bytes=staging_limit_bytes, world_size=workers)
        self.base_url, self.http = client.base_url, client.http


def http_channel(name: str, base_url: str, timeout_s: float, session: Any, world_size: int | None) -> tuple[HTTPWeightSyncClient, int]:
    """The channel to the dev-mode server at `base_url` for engine `name`, and its world size (asked
    when None): a URL that is not one, or that nobody answers, fails here with the fix."""
    import requests

    parts = urlsplit(base_url) if isinstance(base_url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"engine {name!r}: base_url must be http(s)://HOST:PORT, got {base_url!r}")
    client = HTTPWeightSyncClient(base_url, timeout_s, session)
    if world_size is not None:
        return client, world_size
    try:
        return client, client.world_size()
    except requests.RequestException as exc:
        client.close()
        raise ConnectionError(
            f"engine {name!r}: no vLLM server answers at {client.base_url} ({type(exc).__name__}); start "
            f"`vllm serve` there with VLLM_SERVER_DEV_MODE=1 and --worker-extension-cls {WORKER_EXTENSION}, "
            "or fix the URL"
        ) from None
