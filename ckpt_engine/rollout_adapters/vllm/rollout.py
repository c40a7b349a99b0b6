"""vLLM: one handle, `VllmRollout`, over a channel; the channel picks the route to the workers.

Channels (`vllm/clients.py`, `vllm/native.py`; docs/vllm.md's table says what each carries):
- an in-process `vllm.LLM` (`LLMWeightSyncClient`) or a dev-mode `vllm serve` over HTTP
  (`HTTPWeightSyncClient`, `VLLM_SERVER_DEV_MODE=1`; `VllmServerRollout` builds it from a URL):
  vLLM started with `worker_extension_cls=WORKER_EXTENSION`, driven through `collective_rpc`;
- `WeightTransferChannel(client)`: vLLM started with `--weight-transfer-config
  '{"backend": "ckpt_engine"}'`, driven through vLLM's own weight-transfer API.
Weights go only through the weight-sync group, into ranks `rank_offset + worker rank`.

One sync: validate (manifest checked against vLLM's own parameters after its stacking rules; its
answer says each worker's version and group: the session's membership query) -> pause the
scheduler -> receive (layerwise reload, bucket by bucket) -> finalize (layerwise post-processing,
prefix-cache reset, weight version stamped; vLLM tags output tokens with it) -> resume. From its
group join or validate to its resume, swap or discard a sync holds the engine against peer joins,
and a join holds it against syncs (`vllm/holds.py`).

A staged sync (`receive(..., stage=...)` then `swap`): the workers receive on a background thread
while the engine keeps generating (`vllm/staging.py`) and report its end in the group's store
(`vllm/stage_outcome.py`); the swap pauses the scheduler, loads the staged version through
layerwise reload (vLLM runs it between two engine steps, on every worker) beside the cache reset
and the version stamp, and resumes. vLLM's `weight_versions` spans then show which tokens of a
request came from which version.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from ckpt_engine.delta.request import DeltaRequest
from ckpt_engine.elastic.join import PeerJoinable
from ckpt_engine.engine import Rendezvous
from ckpt_engine.installed import InstalledReport, InstalledRequest
from ckpt_engine.manifest import BucketManifest, ManifestBudget
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.rollout_adapters.base import STAGES, JoinOptions, ManifestRejectedError, Membership, ReceiveReport, RolloutAdapter, version_of
from ckpt_engine.rollout_adapters.capabilities import EngineCapabilities
from ckpt_engine.rollout_adapters.vllm.clients import PAUSE_MODES, Channel, HTTPWeightSyncClient, LLMWeightSyncClient
from ckpt_engine.rollout_adapters.vllm.holds import EngineHolds
from ckpt_engine.rollout_adapters.vllm.liveness import ask_held, gone_worker, world_size_problem
from ckpt_engine.rollout_adapters.vllm.native import WeightTransferChannel
from ckpt_engine.rollout_adapters.vllm.routes import WORKER_EXTENSION, ExtensionRoute, folded_finalize
from ckpt_engine.rollout_adapters.vllm.stage_outcome import StagedOutcomes

if TYPE_CHECKING:
    import vllm

__all__ = ["WORKER_EXTENSION", "VllmRollout"]

logger = logging.getLogger(__name__)


class VllmRollout(RolloutAdapter, PeerJoinable):
    """Handle on one vLLM engine over a channel: an in-process `vllm.LLM` (`llm`, driven through
    `LLMWeightSyncClient`) or any `Channel` (`HTTPWeightSyncClient`: what `VllmServerRollout` builds
    from a URL; `WeightTransferChannel`: vLLM's weight-transfer API). The channel's route decides
    which capabilities below it carries (`Route.lacks`).

    In process, call `sync` from a thread other than one generating with the same `LLM`: control
    calls go through `llm.collective_rpc`, which queues behind a running `generate`.

    Peer joins (`ckpt_engine.elastic.join_from_peer`, `vllm/peer.py`): as a peer it offers the
    checkpoint-layout image its last staged sync left; as a joiner it stages a pull of a peer's and
    swaps it in. Over the worker extension, one worker per engine.
    """

    capabilities = EngineCapabilities(delta=True, many_senders=True, regions=True, stages=True, stages_regions=True, installed=True, checks_at_receive=True, bounded_calls=True)
    """Delta: each worker keeps a base copy, applies patches there, reloads full tensors. Regions:
    each worker states the regions its loaders read (`receive_plans`). Staged: workers receive on a
    background thread while the engine steps and `swap` loads; with receive plans each worker keeps
    its region items (only its slice bytes, checked against its plan as they land) and the swap
    assembles and loads them. Installed: each worker digests what vLLM's loaders installed, in
    vLLM's own layout (`vllm/installed.py`; armed before the stream)."""

    def __init__(
        self, name: str, llm: vllm.LLM | Channel, *, timeout_s: float = 300.0, staging_limit_bytes: int | None = None,
        world_size: int | None = None,
    ) -> None:
        """`world_size`: the engine's worker count (asked of the channel when None)."""
        if staging_limit_bytes is not None and (isinstance(staging_limit_bytes, bool) or not isinstance(staging_limit_bytes, int) or staging_limit_bytes < 0):
            raise ValueError(f"engine {name!r}: staging_limit_bytes must be a non-negative int or None, got {staging_limit_bytes!r}")
        self.name = name
        self.timeout_s: float = timeout_s
        self.staging_limit_bytes = staging_limit_bytes
        self.pids: list[int] = []
        self.version: int | None = None
        self.last_finalize: dict[str, Any] = {}
        self.version_from: str | None = None
        """Where the version it holds came from: "trainer sync" or "peer pull from <peer>"."""
        self._pause_mode = "keep"
        self._cache_reset = False
        """Whether this sync's prefix-cache reset already ran beside its transfer."""
        self.staged = StagedOutcomes(name, timeout_s)  # staged receives report their end in the group's store
        channels = (HTTPWeightSyncClient, LLMWeightSyncClient, WeightTransferChannel)
        self.client: Channel = llm if isinstance(llm, channels) else LLMWeightSyncClient(llm, timeout_s, name=repr(name))
        self.workers = self.client.route(name, timeout_s, self.capabilities.weights == "adapters")
        self.capabilities = replace(self.capabilities, **cast(dict[str, Any], dict.fromkeys(self.workers.lacks, False)))
        self.world_size = world_size if world_size is not None else self.client.world_size()
        self._world_told = world_size is not None  # the caller's: checked against the engine's before the first join
        self._learned = False  # whether the handle knows what the engine holds (its joins and syncs, or asked once: `health`)
        self._stale = False  # asked once (`health`): a worker said a failed sync left it part new; until this handle completes one
        lease = self.workers if isinstance(self.workers, ExtensionRoute) and not self.workers.methods else None  # the routes with peer calls
        self.holds = EngineHolds(name, lease, timeout_s)
        self.membership_at_validate = lease is not None  # the full-weight `ckpt_validate` answers each worker's `member`
        self._validated: Membership | None = None
        self._finalize_with: tuple[int, Callable[[], InstalledReport | None] | None] | None = None  # `finalize_with_receive`'s, until the receive takes it
        self._finalized: tuple[int, list[dict[str, Any]]] | None = None  # the version the receive finalized, its answers

    def engine_key(self) -> Hashable:
        return self.client.engine_key()

    def take_over(self, previous: RolloutAdapter) -> None:
        """A new handle on the same engine: the workers' pids, the manifest they hold, the group its
        staged receives report in."""
        if isinstance(previous, VllmRollout):
            self.pids, self.version, self.version_from = list(previous.pids), previous.version, previous.version_from
            self._learned, self._stale = previous._learned, previous._stale
            self.holds.take_over(previous.holds)
            self.workers.take_over(previous.workers)
            self.staged.take_over(previous.staged)

    def arm_installed(self, request: InstalledRequest) -> None:
        """Tell every worker the installed-weight check before the stream (`ArmsInstalledChecks`)."""
        self.workers.arm_installed(request)

    def installed_digests(self, request: InstalledRequest) -> list[InstalledReport]:
        return self.workers.installed(request)

    def held_version(self) -> int | None:
        """The version the engine's workers hold (the extension keeps it across adapter objects),
        else the engine's own stamp."""
        return self.membership().version

    def membership(self) -> Membership:
        """One `ckpt_health` of every worker: the newest version any holds, and the group each
        joined; a worker whose pid is not the one that joined restarted (it is in no group). A
        route that cannot ask the workers: the engine's stamp, groups unknown unless the stamp went
        back to vLLM's first one (the server restarted: its workers are in no group)."""
        replies = self.workers.health()
        if replies is None:  # vLLM's stamp back at its start ("default") under a handle that stamped one: restarted at its address
            stamp = self.client.weight_version()
            restarted = stamp != "" and version_of(stamp) is None and self.version is not None
            return Membership(version_of(stamp), [None] * self.world_size if restarted else None)
        return self._membership_of(replies)

    def validated_membership(self) -> Membership | None:  # what the last validate's answers said (`member`), taken once
        validated, self._validated = self._validated, None
        return validated

    def _membership_of(self, replies: list[dict[str, Any]]) -> Membership:  # from each worker's pid, version, group
        versions = {version_of(h.get("version")) for h in replies}
        if len(versions) > 1:
            logger.warning("engine %s: workers report different versions %s", self.name, sorted(map(str, versions)))
        groups = [h.get("group") if isinstance(h.get("group"), str) else None for h in replies]
        if self.pids and [h.get("pid") for h in replies] != self.pids:
            groups = [None] * len(replies)
        return Membership(max((v for v in versions if v is not None), default=None), groups, any(bool(h.get("stale")) for h in replies))

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions) -> None:
        self._join(rendezvous, rank_offset, options, None, False)

    def _join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions, adapters: int | None, preload: bool) -> None:
        if self._world_told and (problem := world_size_problem(self.name, self.world_size, self.client.world_size())):
            raise ValueError(problem)  # refused at once: the group's rendezvous would wait for ranks that never come
        self._world_told, self._learned = False, True
        self.holds.for_sync()  # before the workers join: a peer join holding them refuses it by name
        try:
            self.staged.join(rendezvous, list(range(rank_offset, rank_offset + self.world_size)))
            self.pids = self.workers.join(rendezvous, rank_offset, options, adapters, preload)
        except BaseException:
            self.holds.let_go()
            raise

    def manifest_budget(self) -> ManifestBudget:
        """The most any of the engine's workers would decode (each worker's `ManifestBudget` from its
        own model and group): a process that decodes manifests for the engine sizes its decode by it."""
        replies = self.workers.budgets()
        return ManifestBudget(**{k: max(int(r[k]) for r in replies) for k in ("tensors", "nbytes", "name_bytes", "ndim", "senders")})

    def receive_plans(self) -> list[ReceivePlan | None]:
        """Per worker rank, the regions it holds, recorded in each worker from vLLM's own loaders
        (None: that worker could not record one and receives whole tensors; every worker, where
        the handle takes no region delivery)."""
        if not self.capabilities.regions:
            return [None] * self.world_size
        plans: list[ReceivePlan | None] = []
        for rank, reply in enumerate(self.workers.plans()):
            if reply.get("plan") is None:
                logger.warning("engine %s worker %d: no receive plan (%s); it receives whole tensors", self.name, rank, reply.get("error"))
                plans.append(None)
            else:
                plans.append(ReceivePlan.from_wire(reply["plan"]))
        return plans

    def validate(self, manifest: BucketManifest, encoded: bytes) -> None:
        self._validate(manifest, encoded, None)

    def validate_regions(self, manifest: BucketManifest, encoded: bytes, assignments: list[bytes]) -> None:
        """`validate`, each worker also checking its region assignment against its recorded plan."""
        self._validate(manifest, encoded, assignments)

    def _validate(self, manifest: BucketManifest, encoded: bytes, regions: list[bytes] | None) -> None:
        # a sync starts: held until its finalize, swap or discard (the claim rides on the check)
        self._validated, self._finalize_with, self._finalized = None, None, None  # a sync starts
        problems = self.workers.check(manifest.digest, encoded, regions, self.holds.sync_claim())
        self.holds.claimed()
        if isinstance(self.workers, ExtensionRoute) and self.workers.members is not None:  # else asked apart
            self._validated = self._membership_of(self.workers.members)
        if problems:
            raise ManifestRejectedError(self.name, problems)

    def receive(self, manifest: BucketManifest, delta: DeltaRequest | None = None, *, stage: str | None = None) -> ReceiveReport:
        """Receive and load `manifest` (the engine paused), or with `stage` receive it into staging
        on the workers' background threads while the engine keeps generating (then `swap`). Both
        stages land alike here: a delta sync in the workers' checked base images, a dense one in
        their staging copy (`vllm/staging.py`)."""
        if stage is not None and (stage not in STAGES or not self.capabilities.stages):
            raise ValueError(f"engine {self.name!r}: stage must be one of {', '.join(STAGES)} or None (and the handle able to stage), got {stage!r}")
        request = delta.to_dict() if delta is not None else None
        t0 = time.perf_counter()
        if stage is None:
            # Paused (requests frozen, dropped or to be recomputed), the engine caches nothing new
            # until it resumes: its prefix cache is reset beside the transfer. Unpaused (`none`),
            # requests still run, and the reset waits for the finalize.
            early = self._pause_mode != "none"
            reset = functools.partial(self._reset_prefix_cache, running=self._pause_mode == "recompute")
            self._cache_reset = False
            fold, self._finalize_with = self._finalize_with, None
            if fold is None or not early or not isinstance(self.workers, ExtensionRoute) or self.workers.methods:  # full weights fold
                replies = self.workers.receive(manifest.digest, request, beside=reset if early else None)
            else:
                replies = self._receive_and_finalize(self.workers, manifest.digest, request, reset, *fold)
            self._cache_reset = early
        else:
            with self.staged.receiving() as ticket:  # from here a discard stops the wait
                self.workers.stage(manifest.digest, ticket, request, stage)
                outcomes = self.staged.wait(ticket)  # each worker reports its end in the group's store
            self.staged.check(outcomes, self.discard)
            replies = self.workers.staged_reports()
        if replies is None:  # the route has no worker reports: the whole manifest, timed here
            seconds = time.perf_counter() - t0
            return ReceiveReport(manifest.num_tensors, manifest.total_bytes, seconds, seconds, manifest.num_tensors)
        reports = [ReceiveReport.from_dict(r) for r in replies]
        slowest = max(reports, key=lambda r: r.receive_s)
        return ReceiveReport(slowest.tensors, slowest.bytes, slowest.receive_s, max(r.load_s for r in reports), min(r.loaded for r in reports), dict(slowest.extra))

    def finalize_with_receive(self, version: int, installed: Callable[[], InstalledReport | None] | None = None) -> None:
        self._finalize_with = (version, installed)

    def _receive_and_finalize(self, route: ExtensionRoute, digest: str, request: Any, reset: Any, version: int, installed: Any) -> list[dict[str, Any]]:
        """The receive, finalized (where a check's digests agree) and the claim let go in its last call once it and the reset went through."""
        syncing = self.holds.syncing
        try:
            replies = route.receive(digest, request, beside=reset, finalize=version, release=self.holds.sync_release(), installed=installed)
        except BaseException:
            self.holds.syncing = syncing  # not let go: the failed sync's resume lets go
            raise
        self._finalized = (version, [r.pop("finalized", None) for r in replies])  # None: not finalized (a check's digests differ)
        return replies

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
        self.version, self.version_from, self._stale = version, "trainer sync", False
        self._resume_after_swap()
        stall = time.perf_counter() - t0
        self.holds.let_go()  # the sync ended (a peer pull's swap: no sync holds the engine)
        self.last_finalize = {
            "post_process_s": max((float(r["finalize_s"]) for r in replies), default=0.0),
            "swap_load_s": max((float(r["load_s"]) for r in replies), default=0.0),
            "swap_shadow": all(bool(r.get("shadow", False)) for r in replies),  # every worker copied a prepared image
            "swap_shadow_layers": [int(r.get("shadow_layers", 0)) for r in replies],  # per worker: the layers it prepared
            "swap_shadow_bytes": [int(r.get("shadow_bytes", 0)) for r in replies],  # per worker: their tensors' bytes
            "shadow_build_s": max((float(r.get("shadow_build_s", 0.0)) for r in replies), default=0.0),  # on the staging thread
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
            self.client.set_weight_version(str(version))

        if not self.client.side_calls:
            replies = self.workers.swap(version)
            stamp()
            return replies
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-swap-stamp") as side:
            stamped = side.submit(stamp)
            try:
                replies = self.workers.swap(version)
            except BaseException:
                if stamped.exception(timeout=self.timeout_s) is None and self.version is not None:
                    try:
                        self.client.set_weight_version(str(self.version))
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
        self.holds.let_go()  # a sync that ended without its finalize (a failed one) lets go here

    def _pause_for_swap(self, mode: str) -> None:  # `mode` keep/abort/recompute, by the channel's quickest route
        self._pause_mode = mode
        self.client.pause_for_swap(mode)

    def _resume_after_swap(self) -> None:
        self.client.resume_after_swap()

    def _reset_prefix_cache(self, running: bool = False) -> None:
        """Drop the prefix cache; `running`: also preempt running requests (they re-prefill). vLLM refuses while requests kept in flight hold KV blocks, whose old-weight KV a new request with their prefix would reuse: then those are preempted too, as vLLM's own cache-clearing pause does."""
        if not self.client.reset_prefix_cache(running) and (running or not self.client.reset_prefix_cache(True)):
            raise RuntimeError(f"engine {self.name!r}: vLLM refused to reset its prefix cache even with running requests preempted")

    def weight_version(self) -> str:
        if not self.client.features.engine_weight_versions:  # only the workers hold it (vllm/compat.py)
            return str(self.held_version())
        return self.client.weight_version()

    def health(self) -> dict[str, Any]:
        """Raise if the engine is dead; else the version the handle knows it holds: its syncs' stamp or,
        before it joined, what the workers report (asked once: a restarted daemon or trainer carries on
        from it; `stale` while they said a failed sync left them part new). A worker it joined is gone:
        dead, unless others answer (`vllm/liveness.py`)."""
        gone = gone_worker(self.name, self.pids) if self.client.local else None
        try:
            self.client.health()
        except Exception as exc:  # with a worker gone, that is the news
            if gone is None and not isinstance(exc, RuntimeError):
                raise
            raise RuntimeError(gone or f"engine {self.name!r}: {exc}") from exc
        held = ask_held(self.name, gone, self.membership) if gone is not None or not self._learned else None
        if held is not None:
            if gone is not None:  # others answered: restarted at its address, holding nothing of this handle's
                self.pids, self.version, self.version_from = [], None, None
            self.version, self._learned, self._stale = self.version if self.version is not None else held.version, True, held.stale
        return {"pids": self.pids, "version": self.version, "version_from": self.version_from, **({"stale": True} if self._stale else {})}

    def close(self) -> None:
        self.client.close()

    def discard(self) -> None:
        """Drop a staged version on every worker; the live weights and version are untouched. A
        staged receive still waiting for the workers' outcomes on another thread stops waiting."""
        idle = self.staged.stop()
        try:
            self.workers.discard()
        finally:
            self.staged.clear(idle)
        self.holds.let_go()  # a failed staged sync ends here

    def staging_room(self, nbytes: int) -> bool:
        """Whether every worker can hold a staging copy of `nbytes` (within `staging_limit_bytes`).
        With receive plans the session asks for the largest rank's slice bytes, which is what a
        worker's staging copy then holds (its region items, `vllm/staging.py`)."""
        if not self.capabilities.stages:
            return False
        short = self.workers.room(nbytes, self.staging_limit_bytes)
        if short:
            logger.info("engine %s: no room for a staging copy (%s)", self.name, "; ".join(short))
        return not short

    def finalize(self, version: int) -> None:
        t0 = time.perf_counter()
        done, self._finalized = self._finalized, None  # the workers finalized in the receive's last call, or now (letting go of the claim)
        folded = done[1] if done is not None and done[0] == version and None not in done[1] else None
        replies = self.holds.finalize(lambda owner: folded_finalize(folded) if folded is not None else self.workers.finalize(version, owner), folded is not None)
        t1 = time.perf_counter()
        if not self._cache_reset:  # else reset beside the transfer (`receive`)
            self._reset_prefix_cache(running=self._pause_mode == "recompute")
        self._cache_reset = False
        self.client.set_weight_version(str(version))
        self.version, self.version_from, self._stale = version, "trainer sync", False
        self.last_finalize = {
            "post_process_s": max((float(r["finalize_s"]) for r in replies), default=0.0),
            "finalize_rpc_s": t1 - t0,
            "cache_and_version_s": time.perf_counter() - t1,
        }

    # --- peer joins (ckpt_engine.elastic; the worker side: vllm/peer.py) -------------------------
    def peer_rpc(self, method: str, timeout_s: float | None = None, **params: Any) -> Any:
        """`ckpt_<method>` on the engine's one worker (an offer travels as the channel carries bytes),
        naming the join that holds the engine, if one does."""
        route = self._peer_route()
        if self.holds.join_owner is not None:
            params.setdefault("owner", self.holds.join_owner)
        if "offer" in params:
            params["offer"] = route.channel.encode(params["offer"])
        (reply,) = route.rpc(f"ckpt_{method}", params, timeout_s)
        return reply

    def peer_offer(self, version: int, timeout_s: float) -> bytes:
        return base64.b64decode(self.peer_rpc("peer_offer", version=version, open_s=timeout_s))

    @contextlib.contextmanager
    def joining(self, owner: str, timeout_s: float) -> Iterator[None]:
        """Held for the join `owner` (`vllm/holds.py`): a sync's group join or validate meanwhile is refused by name."""
        with self.holds.joining(owner, timeout_s):
            yield

    def pull_from_peer(self, offer: bytes, version: int, peer: str, timeout_s: float) -> dict[str, Any]:
        """Stage the pull on the worker (checked against its model first), wait for its reads and
        checks while the engine keeps serving what it held, then swap it in as a staged sync's
        version. A failed pull installs nothing and raises, naming why."""
        t0 = time.perf_counter()
        route = self._peer_route()
        try:
            self.peer_rpc("peer_pull", offer=offer, version=version, peer=peer, read_timeout_s=timeout_s)
        except Exception as exc:  # a bad offer, refused by the worker before it allocated anything
            raise RuntimeError(f"engine {self.name!r} did not start the pull of version {version} from peer {peer} (nothing allocated or installed): {exc}") from exc
        deadline = time.monotonic() + 2 * timeout_s
        while not (status := route.rpc("ckpt_stage_status", timeout_s=min(self.timeout_s, 30.0))[0]).get("done"):
            if time.monotonic() > deadline:
                status = {"error": f"its reads did not end within {2 * timeout_s:.0f}s"}
                break
            time.sleep(0.02)
        if status.get("error"):
            route.discard()
            raise RuntimeError(f"engine {self.name!r}: the pull of version {version} from peer {peer} failed ({status['error']}); nothing was installed")
        stall = self.swap(version, "keep")
        self.version_from = f"peer pull from {peer}"
        got = dict(status["report"])
        phases = {**dict(got.get("phases") or {}), "shadow": float(got.get("shadow_s", 0.0)), "swap": stall}
        return {"version": version, "peer": peer, "bytes": got["bytes"], "tensors": got["tensors"], "seconds": time.perf_counter() - t0, "phases": phases,
                "prepare": dict(got.get("prepare") or {})}

    def _peer_route(self) -> ExtensionRoute:
        if not isinstance(self.workers, ExtensionRoute):
            raise RuntimeError(f"engine {self.name!r}: peer joins go through ckpt-engine's worker extension; this handle's route ({type(self.workers).__name__}) has no ckpt_peer_* calls")
        if self.world_size != 1 or self.workers.methods:
            raise RuntimeError(f"engine {self.name!r}: peer joins take full-weight engines of one worker for now; it has {self.world_size} (TP/PP > 1 is left for later)")
        return self.workers

    def leave(self) -> None:
        self.staged.leave()  # a wait in flight lets go of the store before the group's store goes away
        try:
            self.workers.leave()
        finally:
            self.holds.let_go()

    def worker_health(self) -> list[dict[str, Any]]:
        """Per-worker state (not usable while a receive is in flight; [] where the route cannot ask)."""
        return self.workers.health() or []

