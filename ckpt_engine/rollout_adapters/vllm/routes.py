"""How `VllmRollout` reaches its engine's workers: a `Route`, which its channel makes.

Two routes carry the same worker-side steps (`VllmReceiverCore` on every worker): the worker
extension's `ckpt_*` methods over `collective_rpc` (`ExtensionRoute`, made by both clients of
`vllm/clients.py`), and vLLM's weight-transfer API (`TransferRoute`, made by `WeightTransferChannel`,
`vllm/native.py`). The handle does everything else once: versions, pauses, staged outcomes (the
group's store), swaps, cache resets, LoRA versions. A route names the features it cannot carry
(`lacks`); the handle's capabilities leave them out, so a session refuses them by name before
anything pauses.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from ckpt_engine.installed import InstalledReport
from ckpt_engine.rollout_adapters.vllm.answers import FAILED
from ckpt_engine.rollout_adapters.capabilities import Feature

if TYPE_CHECKING:
    from ckpt_engine.engine import Rendezvous
    from ckpt_engine.installed import InstalledRequest
    from ckpt_engine.rollout_adapters.base import JoinOptions

__all__ = ["LORA_METHODS", "WORKER_EXTENSION", "ExtensionRoute", "Route", "RpcChannel", "folded_finalize"]

WORKER_EXTENSION = "ckpt_engine.rollout_adapters.vllm.worker.CkptEngineWorkerExtension"

LORA_METHODS = {
    "ckpt_validate": "ckpt_lora_validate",
    "ckpt_receive": "ckpt_lora_receive",
    "ckpt_finalize": "ckpt_lora_finalize",
    "ckpt_health": "ckpt_lora_health",
    "ckpt_leave": "ckpt_lora_leave",
    "ckpt_installed_arm": "ckpt_lora_installed_arm",
    "ckpt_installed": "ckpt_lora_installed",
}
"""An adapter-sync join's worker methods (`vllm/lora_worker.py`) in place of the full-weight ones."""


class Route(Protocol):
    """The worker-side steps of a sync, each on every worker of the engine (`VllmRollout` says what
    each is for). Replies are one dict per worker where the route has them (None or []: it has not)."""

    lacks: frozenset[Feature]
    """Features this route cannot carry (the handle's capabilities leave them out)."""

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions, adapters: int | None, preload: bool) -> list[int]: ...
    def check(self, digest: str, encoded: bytes, regions: list[bytes] | None, claim: dict[str, Any] | None = None) -> list[str]:
        """`claim`: a peer-lease claim the workers take first, in the same call (`vllm/holds.py`)."""
        ...
    def receive(self, digest: str, delta: dict[str, Any] | None, beside: Callable[[], None] | None = None) -> list[dict[str, Any]] | None:
        """`beside`: engine-core work (the prefix-cache reset) the handle runs while the workers
        receive, where the route frees the engine core for it; else right after the receive."""
        ...
    def stage(self, digest: str, ticket: str, delta: dict[str, Any] | None, stage: str) -> None: ...
    def staged_reports(self) -> list[dict[str, Any]] | None: ...
    def swap(self, version: int) -> list[dict[str, Any]]: ...
    def finalize(self, version: int, release: str | None = None) -> list[dict[str, Any]]:
        """`release`: the owner whose peer-lease claim the workers let go of last, in the same call."""
        ...
    def discard(self) -> None: ...
    def room(self, nbytes: int, limit_bytes: int | None) -> list[str]: ...
    def leave(self) -> None: ...
    def plans(self) -> list[dict[str, Any]]: ...
    def budgets(self) -> list[dict[str, Any]]: ...
    def health(self) -> list[dict[str, Any]] | None: ...
    def take_over(self, previous: Route) -> None: ...
    def arm_installed(self, request: InstalledRequest) -> None: ...
    def installed(self, request: InstalledRequest) -> list[InstalledReport]: ...


class RpcChannel(Protocol):
    """A channel with `collective_rpc` to every worker (both clients of `vllm/clients.py`)."""

    def collective_rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]: ...
    def encode(self, data: bytes) -> Any: ...


class ExtensionRoute:
    """The worker extension (`worker_extension_cls=WORKER_EXTENSION`, `vllm/worker.py`) over a
    channel's `collective_rpc`: every route of the table in docs/vllm.md."""

    def __init__(self, channel: RpcChannel, name: str, timeout_s: float, adapters: bool) -> None:
        self.channel, self.name, self.timeout_s = channel, name, timeout_s
        # adapter syncs check vLLM's LoRA model and slots (vllm/lora_installed.py) and finalize apart
        self.lacks: frozenset[Feature] = frozenset(("checks_at_receive",) if adapters else ())
        self.held: str | None = None  # the digest of the manifest every worker holds
        self.methods = LORA_METHODS if adapters else {}  # adapter syncs: the LoRA methods in place of the full-weight ones
        self._arming: InstalledRequest | None = None
        """A check armed for the coming receive: sent with it (no round trip of its own)."""
        self._armed_since_join = False
        """Whether a check was armed since the workers joined: the first one arms apart, before
        anything pauses (its workers may record where regions land: a dry run of the loaders)."""
        self._armed: InstalledRequest | None = None
        self._reported: list[InstalledReport] | None = None
        """The armed check's reports, carried back by the receive (workers of a model that loads in
        place digest what they installed as the receive ends: no round trip of its own)."""
        self.members: list[dict[str, Any]] | None = None
        """Each worker's pid, version and group as its last validate answered them (`ckpt_validate`'s
        `member`; None: not answered): the handle's membership, with no query of its own."""

    def rpc(self, method: str, kwargs: dict[str, Any] | None = None, timeout_s: float | None = None) -> list[Any]:
        """`method(**kwargs)` on every worker (the extension's `ckpt_*`), one result per worker."""
        method = self.methods.get(method, method)
        try:
            results = self.channel.collective_rpc(method, kwargs or {}, timeout_s if timeout_s is not None else self.timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"engine {self.name!r}: {exc}") from None
        except Exception as exc:
            text = str(exc)  # vLLM's wording differs by path: worker getattr, or run_method
            if f"has no attribute '{method}'" not in text and f"Method {method!r} is not implemented" not in text:
                raise
            raise RuntimeError(
                f"engine {self.name!r}: vLLM was started without ckpt-engine's worker extension (its workers have no "
                f"{method!r}); start it with worker_extension_cls={WORKER_EXTENSION!r} (LLM(...) keyword, or "
                f"--worker-extension-cls {WORKER_EXTENSION} for `vllm serve`)"
            ) from exc
        return raise_failures(method, results)  # every worker answered (a raise would leave the others' answers queued in vLLM)

    def join(self, rendezvous: Rendezvous, rank_offset: int, options: JoinOptions, adapters: int | None, preload: bool) -> list[int]:
        """Join every worker (`adapters`: LoRA versions each keeps, for adapter syncs); their pids."""
        self.held, self._armed_since_join = None, False
        where = {"rendezvous": rendezvous.to_dict(), "rank_offset": rank_offset, "options": options.to_dict()}
        if adapters is None:
            results = self.rpc("ckpt_join", where)
        else:
            results = self.rpc("ckpt_lora_join", {**where, "max_versions": adapters, "preload": preload})
        return [int(r["pid"]) for r in results]

    def check(self, digest: str, encoded: bytes, regions: list[bytes] | None, claim: dict[str, Any] | None = None) -> list[str]:
        """Every worker checks the manifest (sent only when they may not hold `digest`); its problems."""
        self._arming, self.members = None, None  # a sync's check is armed after its validate
        args: dict[str, Any] = {"digest": digest, "regions": [self.channel.encode(a) for a in regions]} if regions is not None else {"digest": digest}
        if claim is not None:
            args["claim"] = claim
        replies = self.rpc("ckpt_validate", {**args, "encoded": None if self.held == digest else self.channel.encode(encoded)})
        if any(r.get("need_manifest") for r in replies):
            replies = self.rpc("ckpt_validate", {**args, "encoded": self.channel.encode(encoded)})
        members = [r.get("member") for r in replies]
        self.members = members if all(isinstance(m, dict) for m in members) else None
        problems: list[str] = []
        for rank, reply in enumerate(replies):
            if not reply.get("accepted"):
                problems += [p if len(replies) == 1 else f"worker {rank}: {p}" for p in reply.get("problems") or ["rejected"]]
        self.held = None if problems else digest
        return problems

    def receive(
        self, digest: str, delta: dict[str, Any] | None, beside: Callable[[], None] | None = None, finalize: int | None = None,
        release: str | None = None, installed: Callable[[], InstalledReport | None] | None = None,
    ) -> list[dict[str, Any]]:
        """`finalize` (and `release`): finalized by the workers in the receive's last call where it has
        two (`beside`), each reply then holding `finalized`; else left to `finalize`. `installed`: an
        armed check's source digests (read once the work beside went through; None: not finalized
        here): a worker finalizes only where its own report agrees, and lets the claim go either way."""
        args = {"digest": digest, "delta": delta, **self._arm_with()}
        end: dict[str, Any] = {}
        if beside is None or "ckpt_receive" in self.methods:  # an adapter sync receives inside the call
            replies = self.rpc("ckpt_receive", args, timeout_s=self.timeout_s * 2)
            if beside is not None:
                beside()
        else:  # the workers receive on a thread of their own (`vllm/background_receive.py`)
            # copies out of a colocated sender: the begin answers once they are launched, then the reset
            deadline = time.monotonic() + self.timeout_s * 2  # the receive's bound, the wait for its copies' launch included
            self.rpc("ckpt_receive_begin", {**args, "quiet_s": self.timeout_s * 2}, timeout_s=self.timeout_s * 2 + 5)
            try:
                beside()
                if finalize is not None:  # after the work beside (the cache reset); the claim let go either way
                    expected, end["release"] = installed() if installed is not None else None, release
                    if installed is None or expected is not None:  # a check whose source fold failed: finalized apart
                        end.update(finalize=finalize, **({"installed": expected.to_wire()} if expected is not None else {}))
            finally:  # the receive's own outcome (its error first) once it ended
                end["timeout_s"] = max(1.0, deadline - time.monotonic())
                replies = self.rpc("ckpt_receive_end", end, timeout_s=self.timeout_s * 2 + 5)
        reports = [r.pop("installed", None) for r in replies]
        if self._armed is not None and reports and all(r is not None for r in reports):
            # told the source's digests, a worker finalizes only where its own agree: those are not compared again
            agreed = "installed" in end and all("finalized" in r for r in replies)
            self._reported = [InstalledReport.from_wire(r, agreed=agreed) for r in reports]
        return replies

    def stage(self, digest: str, ticket: str, delta: dict[str, Any] | None, stage: str) -> None:
        """The workers pick what to stage from `delta` (`vllm/staging.py`)."""
        self.rpc("ckpt_stage", {"digest": digest, "ticket": ticket, "delta": delta, **self._arm_with()})

    def _arm_with(self) -> dict[str, Any]:
        """The check armed for this receive, as the receive's own argument (the workers arm first)."""
        arming, self._arming = self._arming, None
        if arming is None:
            return {}
        self._armed = arming
        return {"installed": arming.to_wire()}

    def staged_reports(self) -> list[dict[str, Any]]:
        return [r["report"] for r in self.rpc("ckpt_stage_status", timeout_s=min(self.timeout_s, 30.0))]

    def swap(self, version: int) -> list[dict[str, Any]]:
        return self.rpc("ckpt_swap", {"version": version})

    def finalize(self, version: int, release: str | None = None) -> list[dict[str, Any]]:
        return self.rpc("ckpt_finalize", {"version": version, **({"release": release} if release is not None else {})})

    def discard(self) -> None:
        self.rpc("ckpt_discard")

    def room(self, nbytes: int, limit_bytes: int | None) -> list[str]:
        replies = self.rpc("ckpt_staging_room", {"nbytes": int(nbytes), "limit_bytes": limit_bytes})
        return [f"worker {rank}: {r['why']}" for rank, r in enumerate(replies) if not r.get("room")]

    def leave(self) -> None:
        self.rpc("ckpt_leave")

    def plans(self) -> list[dict[str, Any]]:
        return self.rpc("ckpt_receive_plan")

    def budgets(self) -> list[dict[str, Any]]:
        return self.rpc("ckpt_manifest_budget")

    def health(self) -> list[dict[str, Any]]:
        return self.rpc("ckpt_health", timeout_s=min(self.timeout_s, 30.0))

    def take_over(self, previous: Route) -> None:
        if isinstance(previous, ExtensionRoute):
            self.held, self._armed_since_join = previous.held, previous._armed_since_join

    def arm_installed(self, request: InstalledRequest) -> None:
        """Before the stream: every worker learns the check (`vllm/installed.py`), with the receive
        (the first check since a join, and adapter syncs: a round trip of its own, before anything
        pauses)."""
        from ckpt_engine.rollout_adapters.vllm.installed import arm_workers

        self._arming, self._armed, self._reported = None, None, None
        if self._armed_since_join and not self.methods:
            self._arming = request
            return
        arm_workers(self, request, self.timeout_s)
        self._armed, self._armed_since_join = request, True

    def installed(self, request: InstalledRequest) -> list[InstalledReport]:
        """After the stream (staged: after the swap): one report per worker rank."""
        from ckpt_engine.rollout_adapters.vllm.installed import worker_reports

        armed, reported, self._armed, self._reported = self._armed, self._reported, None, None
        if reported is not None and armed == request:
            return reported
        return worker_reports(self, request, self.timeout_s)

    def collective_rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[Any]:
        """The channel's call with this route's wording of failures (what `vllm/installed.py` takes)."""
        return self.rpc(method, kwargs, timeout_s)


def raise_failures(method: str, results: list[Any]) -> list[Any]:
    """`results`, one answer per worker, unless a worker answered a failure (`{FAILED: ...}`,
    `vllm/answers.py`): then a RuntimeError naming `method`, the first failed worker and its error."""
    failed = [(rank, r[FAILED]) for rank, r in enumerate(results) if isinstance(r, dict) and FAILED in r]
    if failed:
        rank, why = failed[0]
        where = f"worker {rank}: " if len(results) > 1 else ""
        more = f" (and {len(failed) - 1} more worker(s) failed)" if len(failed) > 1 else ""
        raise RuntimeError(f"{method} failed: {where}{why}{more}")
    return results


def folded_finalize(replies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The finalize answers that rode on `ckpt_receive_end` (`ExtensionRoute.receive(finalize=)`),
    raising a worker's failure as a finalize of its own would: the worker answers it in place of the
    finalize's reply, which is otherwise taken for one that went through."""
    return raise_failures("ckpt_finalize (in the receive's last call)", replies)
