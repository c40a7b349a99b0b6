"""Shared fixtures and tiers: free ports from the OS, a runner for real multiprocess groups, the
`fast` tier (a minute or two on a 2-core box) and GPU tests skipped without CUDA."""

from __future__ import annotations

import multiprocessing.util
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# A Ray call in a process not connected to Ray starts a local cluster on the calling thread, which Ray
# kills when that thread ends and then ends the whole process (exit 1, no summary): a stray one (a
# job thread outliving its test's cluster) raises instead (read when ray is first imported).
os.environ.setdefault("RAY_ENABLE_AUTO_CONNECT", "0")
# Ray starts its workers at niceness 15 (its `worker_niceness`): beside the suite's other processes
# (or a second suite on the box) they got ~1 % of a core at a load of 10 and took over 10 minutes to
# start an engine. The suite's Ray workers run at the suite's own priority.
os.environ.setdefault("RAY_worker_niceness", "0")
# The temp files of the suite and of every process it starts (vLLM's ZMQ sockets and `vllm_dist_`
# folders, Ray's sessions, multiprocessing's folders) go to one folder, removed when the run ends: a
# run used to leave ~200 sockets and ~30 folders in the system's temp folder. pytest's own `tmp_path`
# folders stay where they were (kept for a failed run's look, as pytest keeps them).
os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())
multiprocessing.util.get_temp_dir()  # this process's own folder stays outside: multiprocessing removes it at exit, after the run's end
SUITE_TMP = tempfile.mkdtemp(prefix="ckt-")  # short: Ray's socket paths under it must stay below 108 bytes
os.environ["TMPDIR"] = SUITE_TMP
tempfile.tempdir = None  # read TMPDIR again

from shared_server import SharedServer  # noqa: E402

# The fast tier (`pytest -m fast`): manifest, planning, config, codec, control frames, the
# registry, transports over real gloo groups and one sync end to end. A file maps to None (every
# test in it) or to the names of the tests it contributes (parametrized cases included).
FAST_TIER: dict[str, frozenset[str] | None] = {
    "test_manifest.py": None,
    "test_stage_outcome.py": None,
    "test_buckets.py": None,
    "test_config.py": None,
    "test_lint.py": None,
    "test_delta_codec.py": None,
    "test_wire.py": None,
    "test_sglang_contract.py": None,
    "test_registry.py": None,
    "test_bad_input.py": None,
    "test_receive_plans.py": None,
    "test_fp8_layout.py": None,
    "test_installed_folds.py": None,
    "test_copy_kernel.py": None,
    "test_fanout_probes.py": frozenset({"test_the_probes_after_a_failure_run_at_once_and_name_the_unreachable", "test_engines_found_dead_after_a_transfer_are_the_ones_named", "test_one_engine_whose_calls_bound_themselves_is_called_on_the_callers_thread", "test_a_session_of_one_reference_receiver_steps_it_on_its_own_thread"}),
    "test_fused_experts.py": frozenset({"test_fuse_specs_stacks_each_layers_experts_in_place_of_the_last", "test_source_yields_stacks_in_metadata_order", "test_stacked_plans_cut_experts_for_ep_and_rows_or_columns_for_tp", "test_a_per_expert_plan_restated_for_stacks_is_the_stacked_plan"}),
    "test_region_footprint.py": None,
    "test_region_waves.py": frozenset({"test_width_is_the_budget_over_one_sets_slots", "test_region_slot_memory_key", "test_waves_keep_every_receivers_sets_in_index_order", "test_ten_disjoint_sets_go_in_one_wave_when_the_width_allows"}),
    "test_loader_trace.py": None,
    "test_vllm_plan_cache_file.py": None,
    "test_vllm_staging.py": None,
    "test_vllm_specs.py": None,
    "test_transfer.py": frozenset({"test_gloo_mixed_dtypes_two_receivers_two_syncs", "test_gloo_three_buffers"}),
    "test_delta_transfer.py": frozenset({"test_chain_of_patches_is_bit_exact", "test_corrupt_patch_is_caught_and_the_old_weights_stay"}),
    "test_sync.py": frozenset({"test_two_syncs_land_bit_exact_and_reuse_the_group", "test_rejected_manifest_moves_nothing"}),
    "test_lora.py": frozenset({"test_check_adapter_names_every_problem", "test_versions_stay_while_requests_use_them_and_at_most_max_live", "test_adapter_syncs_are_bit_exact_and_versions_retire_after_their_last_request"}),
}


@pytest.fixture(scope="session", autouse=True)
def plan_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """vLLM workers keep their receive plans (`vllm/plan_cache.py`) in a temp dir of the session,
    never in the user's cache; set before any engine starts (they inherit it)."""
    path = tmp_path_factory.mktemp("ckpt-engine-cache")
    before = os.environ.get("CKPT_ENGINE_CACHE_DIR")
    os.environ["CKPT_ENGINE_CACHE_DIR"] = str(path)
    try:
        yield path
    finally:
        if before is None:
            os.environ.pop("CKPT_ENGINE_CACHE_DIR", None)
        else:
            os.environ["CKPT_ENGINE_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def spec_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The reference model's spec file (refengines.source(0)), for the reference engines a module starts."""
    from ckpt_engine.rollout_adapters.torch_ref import write_spec_file
    from refengines import source

    path = tmp_path_factory.mktemp("spec") / "spec.msgpack"
    write_spec_file(path, source(0).metadata())
    return str(path)


_STARTED: dict[str, SharedServer] = {}
"""The shared engines' fixtures this session set up, by fixture name."""
_LAST_USER: dict[str, str] = {}
"""Per shared-engine fixture, the last collected test that uses it: its engine stops after that
test instead of at the end of the session (an idle engine holds memory, and its threads cores)."""


def _serve(key: str, shared: SharedServer) -> Iterator[SharedServer]:
    """A session fixture's body: `shared` is known under `key` (the collection hook stops it after
    its last user) and closed when the session ends."""
    _STARTED[key] = shared
    try:
        yield shared
    finally:
        shared.close()


def _answers_health(url: str) -> bool:
    import requests

    try:
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    except requests.RequestException:
        return False


@pytest.fixture(scope="session")
def staged_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[tuple[str, Path]]]:
    """One dev-mode vLLM api_server over the tiny Qwen2 of tests/staged_vllm.py (`served_model`:
    worker extension, `--enable-scale-out`), shared by every module that syncs into it over HTTP:
    `staged_vllm_server.get()` gives (URL, model dir), started again if a test killed it, or after
    `discard()` (a restart), on the same port: the URL stays. Its users leave it serving some version
    of some weights: each seeds its own and reads versions relative to what the engine holds."""
    from helpers_procs import free_port
    from staged_vllm import served_model

    port = free_port()
    shared = SharedServer(
        "tiny-qwen2-http", lambda: served_model(tmp_path_factory.mktemp("qwen2-served"), port), lambda served: _answers_health(served[0])
    )
    yield from _serve("staged_vllm_server", shared)


def _engine_core_alive(llm: object) -> bool:
    """vLLM's own flag for an in-process `LLM` whose engine core died (its monitor sets it)."""
    return not llm.llm_engine.engine_core.resources.engine_dead  # type: ignore[attr-defined]


@pytest.fixture(scope="session")
def qwen2_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[object]]:
    """One in-process vLLM `LLM` (TP=1) over the tiny Qwen2 of tests/test_vllm_adapter.py (dummy
    weights, tests/_vllm_stall_ext.py's extension: the library's worker extension plus the test-only
    fault plants, state reads and the one-call stall), shared by test_vllm_adapter.py,
    test_installed_checks_vllm.py, test_vllm_sync_calls.py and test_vllm_engine_core_calls.py:
    `qwen2_llm.get()` gives the `LLM`. Users seed their own weights, read versions relative to what
    it holds, take back a fault they plant, let a stall they plant end and close the sessions
    `sync_rollout_weights` cached for it (`close_sessions`) when they are done."""
    from contextlib import contextmanager

    from _vllm_stall_ext import EXTENSION
    from helpers_vllm import ENGINE_ARGS, stop_llm
    from test_vllm_adapter import PREFIX_MODEL_LEN, QWEN2_CONFIG

    @contextmanager
    def started() -> Iterator[object]:
        from vllm import LLM

        from ckpt_engine.sync.api import close_sessions

        d = tmp_path_factory.mktemp("qwen2-llm")
        (d / "config.json").write_text(__import__("json").dumps(QWEN2_CONFIG))
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        llm = LLM(
            model=str(d), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
            worker_extension_cls=EXTENSION, **{**ENGINE_ARGS, "max_model_len": PREFIX_MODEL_LEN},
        )
        try:
            yield llm
        finally:
            close_sessions()  # cached sessions leave the group before the engine stops
            stop_llm(llm)

    yield from _serve("qwen2_llm", SharedServer("qwen2-llm", started, _engine_core_alive))


@pytest.fixture(scope="session")
def elastic_vllm_peer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[tuple[object, Path]]]:
    """The serving peer A of test_elastic_vllm_join.py, _holds.py and _failover.py (two engine starts
    fewer): one in-process vLLM `LLM` over the tiny Qwen2 of tests/test_vllm_adapter.py (dummy
    weights, tests/_vllm_peer_faults.py's extension); `.get()` gives (LLM, model dir). Each module
    syncs it in a session of its own (closed when the module ends), reads versions relative to what
    it holds and starts its own joiner B from the model dir (a join needs an engine that never held
    a version)."""
    from contextlib import contextmanager

    from _vllm_peer_faults import EXTENSION
    from helpers_vllm import stop_llm
    from test_elastic_vllm_join import start_llm
    from test_vllm_adapter import QWEN2_CONFIG

    @contextmanager
    def started() -> Iterator[tuple[object, Path]]:
        d = tmp_path_factory.mktemp("qwen2-elastic")
        (d / "config.json").write_text(__import__("json").dumps(QWEN2_CONFIG))
        llm = start_llm(d, EXTENSION)
        try:
            yield llm, d
        finally:
            stop_llm(llm)

    yield from _serve("elastic_vllm_peer", SharedServer("qwen2-elastic-peer", started, lambda served: _engine_core_alive(served[0])))


@pytest.fixture(scope="session")
def elastic_vllm_spare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[object]]:
    """A second engine like `elastic_vllm_peer`'s A (same model, same extension): the joiner B of
    test_elastic_vllm_join.py, then the peer C that test_elastic_vllm_failover.py syncs and kills
    (`kills_shared_engine`: it runs last), one engine start fewer; `.get()` gives the `LLM`. A user
    that needs an engine that never held a version checks that and `discard()`s one that did."""
    from contextlib import contextmanager

    from _vllm_peer_faults import EXTENSION
    from helpers_vllm import stop_llm
    from test_elastic_vllm_join import start_llm
    from test_vllm_adapter import QWEN2_CONFIG

    @contextmanager
    def started() -> Iterator[object]:
        d = tmp_path_factory.mktemp("qwen2-elastic-spare")
        (d / "config.json").write_text(__import__("json").dumps(QWEN2_CONFIG))
        llm = start_llm(d, EXTENSION)
        try:
            yield llm
        finally:
            stop_llm(llm)

    yield from _serve("elastic_vllm_spare", SharedServer("qwen2-elastic-spare", started, _engine_core_alive))


@pytest.fixture(scope="session")
def lora_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen2 of tests/test_vllm_adapter.py with real random weights (seed 0) saved, for the
    LoRA tests: with dummy weights a LoRA changes nothing visible."""
    import torch
    import transformers
    from test_vllm_adapter import QWEN2_CONFIG

    d = tmp_path_factory.mktemp("qwen2-lora")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(**{k: v for k, v in QWEN2_CONFIG.items() if k not in ("architectures", "torch_dtype")})
    config.architectures = ["Qwen2ForCausalLM"]
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(d)
    return d


@pytest.fixture(scope="session")
def lora_qwen2_llm(lora_model_dir: Path) -> Iterator[SharedServer[object]]:
    """One in-process vLLM `LLM` with LoRA on (rank 8, 2 slots, 3 CPU adapters) over `lora_model_dir`
    and tests/_vllm_installed_faults.py's extension, shared by test_lora_vllm.py and
    test_installed_checks_vllm_lora.py: `lora_qwen2_llm.get()` gives the `LLM`. Users sync adapters
    under their own engine names (each name its own versions), take back a fault they plant and
    close the sessions they cached."""
    from contextlib import contextmanager

    from _vllm_installed_faults import EXTENSION
    from helpers_vllm import ENGINE_ARGS, stop_llm

    @contextmanager
    def started() -> Iterator[object]:
        from vllm import LLM

        from ckpt_engine.sync.api import close_sessions

        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        llm = LLM(
            model=str(lora_model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", worker_extension_cls=EXTENSION,
            enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3, **ENGINE_ARGS,
        )
        try:
            yield llm
        finally:
            close_sessions()
            stop_llm(llm)

    yield from _serve("lora_qwen2_llm", SharedServer("lora-qwen2-llm", started, _engine_core_alive))


def _native_llm(model_dir: Path, **lora: object) -> Iterator[object]:
    """An in-process vLLM `LLM` started the way a vLLM user starts the native backend
    (`weight_transfer_config={"backend": "ckpt_engine"}`, dummy weights unless `lora`), with only the
    test-only plants (`_vllm_installed_faults.PlantsExtension`, not the library's worker extension)."""
    from _vllm_installed_faults import NATIVE_EXTENSION
    from helpers_vllm import ENGINE_ARGS, stop_llm
    from vllm import LLM

    from ckpt_engine.sync.api import close_sessions

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    weights = {} if lora else {"load_format": "dummy"}
    llm = LLM(
        model=str(model_dir), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        weight_transfer_config={"backend": "ckpt_engine"}, worker_extension_cls=NATIVE_EXTENSION, **weights, **lora, **ENGINE_ARGS,
    )
    try:
        yield llm
    finally:
        close_sessions()
        stop_llm(llm)


@pytest.fixture(scope="session")
def native_qwen2_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[object]]:
    """One native-backend in-process `LLM` over the tiny Qwen2 of tests/test_vllm_adapter.py (dummy
    weights), shared by test_vllm_native.py and test_installed_checks_vllm_native.py (one engine
    start fewer): users read versions relative to what it holds, take back a fault they plant and
    heal the engine with a clean sync before they leave."""
    from contextlib import contextmanager

    from test_vllm_adapter import QWEN2_CONFIG

    @contextmanager
    def started() -> Iterator[object]:
        d = tmp_path_factory.mktemp("qwen2-native-llm")
        (d / "config.json").write_text(__import__("json").dumps(QWEN2_CONFIG))
        yield from _native_llm(d)

    yield from _serve("native_qwen2_llm", SharedServer("qwen2-native-llm", started, _engine_core_alive))


@pytest.fixture(scope="session")
def native_lora_llm(lora_model_dir: Path) -> Iterator[SharedServer[object]]:
    """One native-backend in-process `LLM` with LoRA on (rank 8, 2 slots, 3 CPU adapters) over
    `lora_model_dir` (real weights), shared by test_lora_vllm_native.py and
    test_installed_checks_vllm_lora.py's weight-transfer case (one engine start fewer): users sync
    adapters under their own engine names and take back a fault they plant."""
    from contextlib import contextmanager

    @contextmanager
    def started() -> Iterator[object]:
        yield from _native_llm(lora_model_dir, enable_lora=True, max_lora_rank=8, max_loras=2, max_cpu_loras=3)

    yield from _serve("native_lora_llm", SharedServer("lora-qwen2-native-llm", started, _engine_core_alive))


@pytest.fixture(scope="session")
def tp2_qwen2_llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[object]]:
    """One in-process vLLM `LLM` with tensor_parallel_size=2 over the tiny Qwen2 of
    tests/test_vllm_regions.py (`start_tp2`: dummy weights, the region test extension, which carries
    the installed-check faults too), shared by the modules that sync regions into it and by
    tests/test_installed_checks_vllm_tp2.py: `tp2_qwen2_llm.get()` gives the `LLM`. Users seed their
    own weights and take back a fault they plant; one that changes a loader for good calls `discard()`."""
    from contextlib import contextmanager

    from helpers_vllm import stop_llm
    from test_vllm_regions import CONFIGS, start_tp2

    @contextmanager
    def started() -> Iterator[object]:
        d = tmp_path_factory.mktemp("tp2-qwen2")
        (d / "config.json").write_text(__import__("json").dumps(CONFIGS["qwen2"]))
        llm = start_tp2(d)
        try:
            yield llm
        finally:
            stop_llm(llm)

    yield from _serve("tp2_qwen2_llm", SharedServer("tp2-qwen2-llm", started, _engine_core_alive))


@pytest.fixture(scope="session")
def tp2_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[object]]:
    """One dev-mode vLLM api_server with tensor_parallel_size=2 over the tiny Qwen2 of
    tests/staged_vllm.py (dummy weights, the worker extension, `--enable-scale-out` for
    token-in/token-out requests), shared by the modules that sync regions into it over HTTP:
    `tp2_vllm_server.get()` gives a `helpers_vllm.VllmServer` (`.url`, `.model_dir`), started again
    if a test killed it. Its users take the weights and version the last one left."""
    from contextlib import contextmanager

    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION
    from helpers_vllm import VllmServer, api_server
    from staged_vllm import write_model_dir

    @contextmanager
    def started() -> Iterator[VllmServer]:
        d = write_model_dir(tmp_path_factory.mktemp("tp2-qwen2-http"))
        extra = ["--worker-extension-cls", WORKER_EXTENSION, "--tensor-parallel-size", "2", "--distributed-executor-backend", "mp", "--enable-scale-out"]
        with api_server(d, d / "server.log", extra, env={"VLLM_CPU_OMP_THREADS_BIND": "0|1"}) as server:
            yield server

    yield from _serve("tp2_vllm_server", SharedServer("tp2-qwen2-http", started, lambda server: _answers_health(server.url)))


@pytest.fixture(scope="session")
def native_vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer[object]]:
    """One dev-mode vLLM api_server over the tiny Qwen2 of tests/staged_vllm.py started the way a
    vLLM user starts the native backend (`--weight-transfer-config '{"backend": "ckpt_engine"}'`,
    no worker extension; `--enable-scale-out` for token-in/token-out requests), shared by
    `test_vllm_native.py`'s HTTP test and `test_vllm_native_staged.py`: `.get()` gives a
    `helpers_vllm.VllmServer` (its log is `model_dir / "server.log"`). Users read versions relative
    to what it holds."""
    from contextlib import contextmanager

    from helpers_procs import free_port
    from helpers_vllm import VllmServer, api_server
    from staged_vllm import write_model_dir

    port = free_port()  # `discard()` restarts it at the same URL

    @contextmanager
    def started() -> Iterator[VllmServer]:
        d = write_model_dir(tmp_path_factory.mktemp("qwen2-native-http"))
        extra = ["--enable-scale-out", "--weight-transfer-config", '{"backend": "ckpt_engine"}']
        with api_server(d, d / "server.log", extra, port=port) as server:
            yield server

    yield from _serve("native_vllm_server", SharedServer("tiny-qwen2-native-http", started, lambda server: _answers_health(server.url)))


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, nodeid in _LAST_USER.items():
        if item.nodeid == nodeid and name in _STARTED:
            _STARTED.pop(name).close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "kills_shared_engine: kills an engine other modules share; runs after the last other user of that engine")


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(SUITE_TMP, ignore_errors=True)


SHARED_ENGINES = (
    "staged_vllm_server", "qwen2_llm", "lora_qwen2_llm", "tp2_qwen2_llm", "tp2_vllm_server", "native_vllm_server", "native_qwen2_llm",
    "native_lora_llm", "elastic_vllm_peer",
    "elastic_vllm_spare",
)
"""The session fixtures above: each one engine that several modules use in turn."""


def _group_shared_engine_users(items: list[pytest.Item]) -> None:
    """Reorder whole modules so the users of one shared engine run one after another (the engine
    then stops before the next engine starts: two idle vLLM engines would share the box's cores and
    memory with every test between them). Modules linked by shared engines (users of one engine, or
    a module that uses two) form one group, placed where its first module was; inside it modules go
    by the first and the last engine they use (engines numbered by first use), so where a group is a
    chain (A's users, a module using A and B, B's users) each engine's users stay together. A
    `kills_shared_engine` test runs at its group's end, after the last user of its engine (a later
    user would start it again: correct, only slower), so its module is split and that module's
    fixtures may start a second time for it. Other modules stay whole and keep their order."""
    module_index: dict[str, int] = {}
    engine_number: dict[str, int] = {}
    uses: dict[str, set[int]] = {}
    first_user: dict[str, str] = {}
    parent: dict[str, str] = {}

    def root(module: str) -> str:
        while parent.get(module, module) != module:
            module = parent[module]
        return module

    for item in items:
        module = str(item.path)
        module_index.setdefault(module, len(module_index))
        for name in SHARED_ENGINES:
            if name in item.fixturenames:  # type: ignore[attr-defined]
                uses.setdefault(module, set()).add(engine_number.setdefault(name, len(engine_number)))
                a, b = sorted((root(first_user.setdefault(name, module)), root(module)), key=module_index.__getitem__)
                if a != b:
                    parent[b] = a  # a group's root is its first module
    order = {item.nodeid: i for i, item in enumerate(items)}

    def key(item: pytest.Item) -> tuple[int, bool, int, int, int, int]:
        module = str(item.path)
        used = uses.get(module, {0})
        kills = item.get_closest_marker("kills_shared_engine") is not None
        return (module_index[root(module)], kills, min(used), max(used), module_index[module], order[item.nodeid])

    items.sort(key=key)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Each shared engine's last user among the tests that will run (after `-k`/`-m` deselected
    theirs: the engine stops after it)."""
    for item in session.items:
        for name in SHARED_ENGINES:
            if name in item.fixturenames:  # type: ignore[attr-defined]
                _LAST_USER[name] = item.nodeid


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _group_shared_engine_users(items)
    seen: dict[str, set[str]] = {}
    for item in items:
        file = os.path.basename(str(item.path))
        if file not in FAST_TIER:
            continue
        name = getattr(item, "originalname", item.name)
        seen.setdefault(file, set()).add(name)
        names = FAST_TIER[file]
        if names is None or name in names:
            item.add_marker(pytest.mark.fast)
    for file, names in FAST_TIER.items():  # a renamed or deleted test must not drop out silently
        missing = sorted((names or frozenset()) - seen.get(file, set())) if file in seen else []
        if missing and not config.getoption("-k") and not any("::" in str(a) for a in config.args):  # not when picking tests
            raise pytest.UsageError(f"tests/conftest.py FAST_TIER names tests that {file} no longer has: {missing}")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 1:
        return
    skip = pytest.mark.skip(reason="needs CUDA (run with -m gpu on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
