"""The controller's side of installed-weight checks (issue 42 item 5, `checkpoint_engine.verify_installed`).

A check is due at the syncs of a session until one completes (`first`, the default), at every N-th
sync (N), or never (`off`). When one is due, `arm` lists the (name, region) keys the engine ranks
hold, from their receive plans (a rank without one holds every tensor whole), and the weight walk
(`tap`) folds each tensor's regions as the sender takes it (`ckpt_engine/installed.py`: a few
thousand positions per region, or every element with `verify_installed_samples: 0`), or, when the
source's tensors outlive the sync (`stable_tensors`), notes them and folds them once this rank's
send went through, while the engines load their last bucket and digest (`fold_noted`), their
digests left on the device until `verify` reads them back: off the sync's path (not on a thread of
its own from the walk's end: measured on one H200, its Python held the GIL the sender's last steps
wanted; nor in batches as the walk passes: a one-copy sender, `pipeline/shared_sources.py`, walks
every tensor before the first byte moves). After the stream, before any engine stamps the version
(or, staged, right after the swap), `verify` takes every engine rank's digests of what it
installed, in its own layout (the reference receiver's, and vLLM's where it can, ride on an unstaged
receive's reply; others are asked), and compares (one C loop when all agree): a
difference names the tensor, the region and the engine, and the sync fails with that engine out of
service (paused and stale, as a failed sync leaves it); so does a tensor sent but not installed (a
rank's `missing`). Engines with `ArmsInstalledChecks` are told the check before the stream (vLLM,
whose post-processing repacks a layer once loaded, digests as it loads; the reference receiver
answers in its receive's reply). Tensors of an engine's layout the checked
sync does not write are named once (`unwritten_tensors: warn`, or the sync fails with `error`);
tensors an engine cannot map back to checkpoint regions are named as unchecked.

With many senders (`senders: all`) no rank holds a whole tensor: trainer rank 0 announces the
check with the send (`announcement`: seed, samples and the keys in order), every sending rank
folds its share of each key from its own pieces after its send (`installed_shares.py`, the sampled
positions that fall in its rows: `installed.digest_share_runs`), and after the report round, when every
rank's send succeeded, one more all-gather brings every share to rank 0 (`ManySenders.failed`),
which adds them (`combine`) and compares as for one sender. Not made there with every-element
folds (`verify_installed_samples: 0`), TP helpers (`collective_pieces`) or too many keys to announce.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import operator
import secrets
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import torch

from ckpt_engine.installed import (
    MAX_SEED, ArmsInstalledChecks, Folds, InstalledReport, InstalledRequest, Key, key_text, region_view, wrap64,
)
from ckpt_engine.manifest import BucketManifest
from ckpt_engine.planning.regions import ReceivePlan
from ckpt_engine.sources.base import WeightSource
from ckpt_engine.sources.wire import torch_dtype
from ckpt_engine.rollout_adapters.base import RolloutAdapter
from ckpt_engine.rollout_adapters.capabilities import bounded_within, lacking
from ckpt_engine.sync.fanout import collect_failures

__all__ = ["InstalledChecks"]

logger = logging.getLogger(__name__)
_CUDA = operator.attrgetter("is_cuda")
_TENSOR = operator.itemgetter(1)

MAX_KEYS_BYTES = 100_000
"""The keys travel with the send announcement, beside a region layout of up to 900 kB (1 MiB in all)."""


class InstalledChecks:
    """Held by a WeightSyncSession: when checks are due, the trainer's digests of one sync, the compare."""

    def __init__(self, mode: str | int, samples: int, unwritten: str) -> None:
        self.mode, self.samples, self.unwritten = mode, samples, unwritten
        self.syncs = 0
        """Syncs this session began (the N of `verify_installed: N` counts them)."""
        self.completed = False
        self.request: InstalledRequest | None = None
        """The check armed for the sync under way (None: no check)."""
        self._want: dict[str, list[Key]] = {}
        self._wanted_for: tuple[tuple[tuple[str, ...], tuple[ReceivePlan | None, ...]], dict[str, list[Key]]] | None = None
        self._names_for: tuple[BucketManifest, list[str], dict[str, torch.dtype]] | None = None
        """The last plan `arm_manifest` armed a check for, with its names and wire dtypes."""
        self._folds = Folds(0, samples)
        self._digests: dict[Key, int] = {}
        """Each key's image in `_folds` (the trainer's side of the armed check)."""
        self._said: set[str] = set()
        self._dtypes: dict[str, torch.dtype] = {}
        """The wire dtype of each name of the armed check (`arm`'s `dtypes`; absent: as walked)."""
        self._noted: list[tuple[str, torch.Tensor]] | None = None
        """What a stable walk yielded, for `fold_noted` (None: nothing waits)."""
        self._walked: list[tuple[str, torch.Tensor]] | None = None
        """The source's walk made ahead (`fold_ahead`), which the send replays (`tap`): walked once."""
        self._noted_layout: _Walk | None = None
        """The last stable walk's layout: the same at every check of a session."""
        self._fold_error: Exception | None = None
        self._on_device: tuple[list[Key], torch.Tensor, torch.cuda.Event] | None = None
        """A stable walk's digests folded in one launch (`fold_noted` on a GPU): the keys, their
        digests copied to pinned host memory, the event after that copy."""
        self.ahead = False
        """Whether the armed check's source was noted before the stream (`fold_ahead`)."""
        self._expected: dict[Key, int] | None = None
        """The source's digests of the armed check, once read back (`source_digests`)."""
        self._ready: torch.cuda.Event | None = None
        """Behind the source's writes, for a fold noted ahead (its own stream waits on it)."""
        self._stream: torch.cuda.Stream | None = None
        self._fold_lock = threading.RLock()
        self._order: list[Key] = []
        """The keys of an armed many-sender check, in the order the senders' shares come in."""
        self._combined: dict[Key, int] | None = None
        """The source's digests added from every sender's shares (many senders), once combined."""
        self.engine_seconds: float | None = None
        """The slowest engine rank's own digest time in the last armed check (`InstalledReport.seconds`)."""
        self.seconds: float | None = None
        """What the last armed check took: the trainer's folds during the walk and the compare
        (`SyncReport.seconds["installed_check"]`); None when the sync was not checked."""

    def due(self) -> bool:
        if self.mode == "off":
            return False
        if self.mode == "first":
            return not self.completed
        return not self.completed or self.syncs % int(self.mode) == 0

    def arm(
        self, rollouts: Sequence[RolloutAdapter], names: list[str], plans: Sequence[ReceivePlan | None], senders: int,
        collective: bool = False, dtypes: Mapping[str, str] | None = None,
    ) -> None:
        """Before the walk: arm a check of this sync if one is due and it can be made. `collective`:
        the senders' pieces are collective with TP helpers (no check with many senders). `dtypes`:
        each name's wire dtype (the manifest's): a source tensor of another dtype (cast on the wire,
        `StateDictSource(..., dtype=)`) is folded as the wire carries it, as the engine holds it."""
        self._begin()
        if self.due():
            wire = {n: torch_dtype(d) for n, d in dtypes.items()} if dtypes is not None else {}
            self._arm(rollouts, names, plans, senders, collective, wire)

    def arm_manifest(
        self, rollouts: Sequence[RolloutAdapter], manifest: BucketManifest, plans: Sequence[ReceivePlan | None], senders: int,
        collective: bool = False, source: WeightSource | None = None,
    ) -> None:
        """`arm` with the manifest's names and wire dtypes, worked out only when a check is due, and
        once per plan: a sync with no check due (every sync after the first, by default) then costs
        nothing per tensor (a 30B-A3B's 18,867 names and dtypes cost ~2 ms of host time a sync).
        `source`: the one sender's weights, folded ahead for one engine of one rank that checks at
        its receive (`fold_ahead`, `checks_at_receive`; not with `unwritten_tensors: error`)."""
        self._begin()
        if not self.due():
            return
        if self._names_for is None or self._names_for[0] is not manifest:
            specs = manifest.specs
            self._names_for = (manifest, [s.name for s in specs], {s.name: torch_dtype(s.dtype) for s in specs})
        _, names, wire = self._names_for
        self._arm(rollouts, names, plans, senders, collective, wire)
        one_rank = len(rollouts) == 1 and rollouts[0].world_size == 1 and not lacking(rollouts, "checks_at_receive")
        if self.request is not None and one_rank and source is not None and source.stable_tensors and self.unwritten != "error":
            self.fold_ahead(source)

    def fold_ahead(self, source: WeightSource) -> None:
        """Note a stable source on its GPU before the stream, to fold it once the engines' receives
        are under way (`expected_report`, or the send's end): one launch on a stream of its own,
        behind the source's writes queued so far and beside the transfer, its digests copied to the
        host behind it. An engine told them finalizes in its receive's last call where its own
        agree (no finalize round trip), and the compare after the stream waits on nothing. The fold
        waits for the engine's receive (`expected_report`; colocated: once its worker queued its
        copies, while the device copies): at the send's end it took 1.5 ms of wall time beside the
        worker's copy launches on one H200 (7B, one process). Not on the host, where a fold is
        compute the walk's send hides (`tap`)."""
        t = time.perf_counter()
        noted = self._walked = list(source.iter_weights())  # here, on the session's thread: the receive's thread may fold while the send runs
        on_gpu = bool(noted) and self.samples > 0 and all(map(_CUDA, map(_TENSOR, noted)))  # C loops: ~339 tensors before the pause
        if on_gpu:
            device = noted[0][1].device
            self._ready = torch.cuda.Event()
            self._ready.record(torch.cuda.current_stream(device))
            self._noted, self.ahead = noted, True
        self.seconds = (self.seconds or 0.0) + time.perf_counter() - t

    def expected_report(self) -> InstalledReport | None:
        """The source's digests of a check noted ahead, as a report, folded now if the send's end
        has not (called as the engines' receives end; None: not noted ahead, or the fold failed:
        `verify` raises that)."""
        if not self.ahead:
            return None
        t, before = time.perf_counter(), self.seconds or 0.0
        try:
            digests = self.source_digests()
        except Exception:  # the fold failed: `verify` raises it once the engines answered
            return None
        finally:
            self.seconds = before + time.perf_counter() - t  # the fold's own time included once
        return InstalledReport(digests)

    def _begin(self) -> None:
        """A new sync: nothing armed yet."""
        self.syncs += 1
        self.request, self._digests, self.seconds, self._order, self._combined = None, {}, None, [], None
        self._dtypes, self._noted, self._fold_error, self._on_device, self.ahead, self._ready = {}, None, None, None, False, None
        self._walked = None
        self._expected = None

    def _arm(
        self, rollouts: Sequence[RolloutAdapter], names: list[str], plans: Sequence[ReceivePlan | None], senders: int,
        collective: bool, dtypes: dict[str, torch.dtype],
    ) -> None:
        """Arm the check that is due, if it can be made."""
        self._dtypes = dtypes
        if senders > 1 and self.samples == 0:
            return self._say("installed-weight checks: not made with many senders and verify_installed_samples: 0 "
                             "(an every-element fold reads whole words of a tensor; each sender holds only its rows)")
        if senders > 1 and collective:
            return self._say("installed-weight checks: not made with many senders whose pieces are collective with TP helpers")
        cannot = lacking(rollouts, "installed")
        if cannot:
            self._say(f"installed-weight checks: engine(s) {', '.join(cannot)} cannot digest what they installed; not checked")
        self.request, self.seconds = InstalledRequest(list(names), secrets.randbelow(MAX_SEED), self.samples), 0.0
        self._folds = Folds(self.request.seed, self.samples)
        self._want = self._wanted(names, plans)
        if senders > 1:
            self._order = [k for n in names for k in self._want.get(n, ())]
            if len(msgpack.packb(self._announced_keys(), use_bin_type=True)) > MAX_KEYS_BYTES:
                self.request, self.seconds, self._order = None, None, []
                return self._say(f"installed-weight checks: not made with many senders: the keys exceed the announcement's {MAX_KEYS_BYTES} bytes")
        for r in rollouts:  # ranks that digest while they load (vLLM) learn the check before the stream
            if r.capabilities.installed and isinstance(r, ArmsInstalledChecks):
                try:
                    r.arm_installed(self.request)
                except Exception as exc:
                    raise RuntimeError(f"engine {r.name!r}: could not arm the installed-weight check ({type(exc).__name__}: {exc}); nothing was sent") from exc

    def _wanted(self, names: list[str], plans: Sequence[ReceivePlan | None]) -> dict[str, list[Key]]:
        """Each sent name's keys (its regions some engine rank holds); the same names and plans give
        the same keys at every check of a session, so they are worked out once."""
        cache = (tuple(names), tuple(plans))
        if self._wanted_for is not None and self._wanted_for[0] == cache:
            return self._wanted_for[1]
        sent = set(names)
        want: dict[str, set[Key]] = {}
        for plan in plans or [None]:
            for n in sent if plan is None else sent & set(plan.holds):
                for region in (None,) if plan is None or plan.holds[n] is None else plan.holds[n] or ():
                    want.setdefault(n, set()).add((n, region))
        out = {n: sorted(keys, key=lambda k: (k[1] is not None, k[1])) for n, keys in want.items()}
        self._wanted_for = (cache, out)
        return out

    def _announced_keys(self) -> list[list[Any]]:
        return [[n, r.to_wire() if r is not None else None] for n, r in self._order]

    def announcement(self) -> dict[str, Any] | None:
        """What the other senders need to fold their shares of an armed many-sender check (None: none)."""
        if self.request is None or not self._order:
            return None
        return {"seed": self.request.seed, "samples": self.request.samples, "keys": self._announced_keys()}

    def combine(self, shares: Sequence[Sequence[int] | None]) -> None:
        """Every sender's shares (rank order; None: a rank that could not fold) into the source's digests."""
        t = time.perf_counter()
        missing = [i for i, sh in enumerate(shares) if sh is None or len(sh) != len(self._order)]
        if missing:
            self._say(f"installed-weight checks: trainer rank(s) {', '.join(map(str, missing))} could not fold their shares; not checked")
            self.request = None
        else:
            self._combined = {k: wrap64(sum(int(sh[i]) for sh in shares if sh is not None)) for i, k in enumerate(self._order)}
        self.seconds = (self.seconds or 0.0) + time.perf_counter() - t

    def tap(self, weights: Iterable[tuple[str, torch.Tensor]], stable: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """The weight walk, folding every tensor of an armed check as it passes; or, when every
        tensor it yields stays valid and unchanged for the whole sync (`stable`: the source's
        `stable_tensors`), only noting them for `fold_noted`, after the send, while the engines
        load their last bucket and digest: off the sync's path (on one GPU, a 7B walk's 339 folds
        cost ~9.5 ms of launches in it; an `add` each for later, 0.23 ms of Python on the CPU box;
        noting them, 0.04 ms)."""
        if self._walked is not None:  # walked ahead (`fold_ahead`): the send takes that walk, not a second one
            weights = self._walked
        if self.request is None or self.seconds is None or self.ahead:
            yield from weights
            return
        if stable:
            noted = self._noted = []
            for pair in weights:
                noted.append(pair)
                yield pair
            return
        want, digests, add, dtypes = self._want, self._digests, self._folds.add, self._dtypes
        for name, tensor in weights:
            keys = want.get(name)
            if keys is not None:
                t = time.perf_counter()
                for key in keys:
                    digests[key] = add(region_view(tensor, key[1]), dtypes.get(name))
                self.seconds += time.perf_counter() - t
            yield name, tensor

    def fold_noted(self) -> None:
        """Fold what a stable walk noted (`tap`, `fold_ahead`): called once this rank's send went
        through, while the engines finish (`SyncStream.run`'s `sent`), as the engines' receives end
        (`expected_report`, from the receive's thread), else by `verify`; whichever comes first
        folds, the others wait for it. On a GPU one launch over kept tables
        (`installed_kernel.Folder`: no Python per key but its views), its digests copied to the
        host behind it. Never raises: an error waits for `verify`."""
        with self._fold_lock:
            noted, self._noted = self._noted, None
            if noted is None:
                return
            t = time.perf_counter()
            try:
                names, tensors = (list(c) for c in zip(*noted)) if noted else ([], [])
                walk = self._layout(names)
                keys = walk.keys
                views = tensors if walk.each_once else [tensors[i] if k[1] is None else region_view(tensors[i], k[1]) for k, i in zip(keys, walk.index)]
                if not self._fold_on_device(walk, views):
                    first = self._folds.note(views, walk.casts)
                    self._digests.update(zip(keys, range(first, first + len(keys))))
                    self._folds.read_later()
            except Exception as exc:  # the receives are in flight: the check fails in verify, as before
                self._fold_error = exc
            self.seconds = (self.seconds or 0.0) + time.perf_counter() - t

    def _fold_on_device(self, walk: _Walk, views: list[torch.Tensor]) -> bool:
        """Fold every view in one launch when all are CUDA images the kernel reads as the wire
        carries them (no cast); False (nothing done) otherwise."""
        if self.samples <= 0 or not views or not all(map(_CUDA, views)):
            return False
        from ckpt_engine.installed_kernel import Folder  # Triton: only where a GPU folds

        try:
            folder = Folder(views)
        except ValueError:  # an image the kernel cannot read
            return False
        if not walk.uncast and not all(d is None or d == v for d, v in zip(walk.casts, folder.dtypes)):
            return False
        device = views[0].device
        ready, stream = self._ready, torch.cuda.current_stream(device)
        if ready is not None:  # noted ahead: beside the transfer, behind the source's writes only
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device, priority=-1)  # high: its blocks go between the copies'
            stream = self._stream
            stream.wait_event(ready)
        with torch.cuda.stream(stream):
            folded = folder.launch_all(self._folds.seed, self.samples)  # the armed check's seed (`verify` may have taken the request)
            host = torch.empty(folded.shape, dtype=folded.dtype, pin_memory=True)
            host.copy_(folded, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._on_device = (walk.keys, host, done)
        return True

    def _layout(self, names: list[str]) -> _Walk:
        """The walked `names`' layout (`_Walk`), worked out once for a session's walk (the same
        names, keys and dtypes each check)."""
        kept = self._noted_layout
        if kept is None or kept.names != names or kept.want is not self._want or (kept.dtypes is not self._dtypes and kept.dtypes != self._dtypes):
            want, dtypes = self._want, self._dtypes
            rows = [(key, i, dtypes.get(n)) for i, n in enumerate(names) for key in want.get(n, ())]
            keys, index, casts = (list(c) for c in zip(*rows)) if rows else ([], [], [])
            each_once = index == list(range(len(names))) and all(k[1] is None for k in keys)
            kept = self._noted_layout = _Walk(names, want, dtypes, keys, index, tuple(casts), each_once, all(c is None for c in casts))
        return kept

    def sent(self) -> None:
        """This rank's send went through (`SyncStream.run`): fold what the walk noted while the
        engines finish. A source noted ahead waits for its engine's receive instead
        (`expected_report`), so its fold does not hold the interpreter lock while the engine's
        worker launches its copies (colocated: one process's threads)."""
        if not self.ahead:
            self.fold_noted()

    def release(self) -> None:
        """After a sync: drop what a stable walk noted and a failed sync never folded (its tensors
        would stay alive until the next check)."""
        self._noted, self._on_device, self._expected, self._walked = None, None, None, None
        self._folds.drop_later()

    def source_digests(self) -> dict[Key, int]:
        """The trainer's digest of every key the walk passed (one sender)."""
        with self._fold_lock:  # the send's end and the receive's thread may both ask
            self.fold_noted()
            if self._fold_error is not None:
                raise self._fold_error
            if self._expected is not None:  # read back already (the receive's end, then `verify`)
                return self._expected
            values = self._folds.values() if self._digests else []
            out = dict(zip(self._digests, map(values.__getitem__, self._digests.values())))
            if self._on_device is not None:
                keys, host, done = self._on_device
                done.synchronize()  # the fold and its copy to the host, on the GPU the source's tensors are on
                out.update(zip(keys, host.tolist()))
            self._expected = out
            return out

    def verify(self, pool: cf.Executor, rollouts: Sequence[RolloutAdapter], timeout_s: float) -> dict[str, str]:
        """{engine: what differs} after the stream ({} when all agree, or no check was armed)."""
        request, self.request = self.request, None
        if request is None:
            return {}
        t = time.perf_counter()
        checked = [r for r in rollouts if r.capabilities.installed]
        # Noted ahead: one engine rank, told the source's digests with its receive, answered with it;
        # its answer is read here, not through a pool thread (~0.3 ms of hand-offs on one H200).
        inline = self.ahead and len(checked) == 1 and bounded_within(checked[0], timeout_s)
        futures = {} if inline else {r.name: pool.submit(r.installed_digests, request) for r in checked}
        mine: dict[Key, int] | Exception = {}
        if self._combined is None and not self._order:  # one sender: its digests read back while the engines answer
            try:
                mine = self.source_digests()  # folds a stable walk first if the send's end did not
            except Exception as exc:  # raised once the engines answered, as before
                mine = exc
        failed = collect_failures(futures, "an installed-weight check", timeout_s)
        answers = {name: f.result() for name, f in futures.items() if name not in failed}
        for r in checked if inline else ():
            try:
                answers[r.name] = r.installed_digests(request)  # at hand, or one call bounded by the handle's own timeout (within timeout_s)
            except Exception as exc:
                failed[r.name] = f"{type(exc).__name__}: {exc}"
        if self._combined is not None:  # many senders: every sender's shares, added
            expected = dict(self._combined)
        elif self._order:  # many senders, but the shares never came (a failed send stops earlier)
            self._say("installed-weight checks: the senders' shares did not arrive; not checked")
            return {}
        elif isinstance(mine, Exception):
            raise mine
        else:
            expected = mine
        self.engine_seconds = 0.0
        for r in checked:
            if r.name not in failed:
                reports = answers[r.name]
                self.engine_seconds = max([self.engine_seconds, *(rep.seconds for rep in reports)])
                why = self._compare(r.name, reports, expected)
                if why:
                    failed[r.name] = why
        self.seconds = (self.seconds or 0.0) + time.perf_counter() - t
        return failed

    def _compare(self, engine: str, reports: list[InstalledReport], expected: dict[Key, int]) -> str:
        problems: list[str] = []
        for rank, report in enumerate(reports):
            where = f"rank {rank}" if len(reports) > 1 else "its weights"
            for key, got in () if report.within(expected) else report.digests.items():  # all agree: one C loop
                want = expected.get(key)
                if want is None:
                    problems.append(f"{key_text(key)} ({where}): installed, but no receive plan says the rank holds it")
                elif want != got:
                    problems.append(f"{key_text(key)} ({where}): installed weights differ from the source")
            for what in report.missing:
                problems.append(f"{what} ({where}): sent but not installed")
            if report.unchecked:
                self._say(f"installed-weight checks: engine {engine!r} {where}: unchecked (a loader it cannot follow): {_names(report.unchecked)}")
            if report.unwritten:
                message = f"engine {engine!r} {where}: tensor(s) of its layout no sync of this check writes: {_names(report.unwritten)}"
                if self.unwritten == "error":
                    problems.append(message + " (unwritten_tensors: error)")
                else:
                    self._say(f"installed-weight checks: {message}")
        return "; ".join(problems[:10]) + (f"; ... ({len(problems)} in all)" if len(problems) > 10 else "")

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            logger.warning("%s", message)


@dataclass(frozen=True)
class _Walk:
    """A stable walk's layout for a check: its `names` (with the keys and dtypes it was worked out
    for), each key, the walked tensor it is read from (`index`) and its wire dtype (`casts`, None:
    as walked), whether the keys are the walked tensors themselves (`each_once`: each whole, once,
    in order) and whether no key is cast (`uncast`)."""

    names: list[str]
    want: dict[str, list[Key]]
    dtypes: dict[str, torch.dtype]
    keys: list[Key]
    index: list[int]
    casts: tuple[torch.dtype | None, ...]
    each_once: bool
    uncast: bool


def _names(names: list[str]) -> str:
    return ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
