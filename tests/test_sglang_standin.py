"""The SGLang stand-in keeps SGLang's scheduling semantics, which the adapter must live with.

Pinned here (SGLang 0.5.x, `docs/advanced_features/sglang_for_rl.md` and `io_struct.py`): a pause in
place keeps requests with their KV and the cache cannot be flushed under them; a retract pause keeps
them without KV and can be flushed; an abort pause ends them; the prefix cache serves a prompt's KV
until it is flushed.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
pytest.importorskip("transformers")
pytest.importorskip("requests")

from helpers_sglang import tiny_model  # noqa: E402
from test_sglang_adapter import PROMPT, generate, greedy, model_dir, servers  # noqa: E402,F401  (fixtures)

NUM_LONG = 300
LONG = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": NUM_LONG, "temperature": 0}}


@pytest.fixture()
def server(servers: list[object]) -> Iterator[object]:  # noqa: F811
    client = servers[0]
    yield client
    client._call("POST", "/continue_generation", {})  # type: ignore[attr-defined]


def _flush_status(client: object) -> int:
    return client.http.post(f"{client.base_url}/flush_cache", timeout=30).status_code  # type: ignore[attr-defined]


def _start_long_request(client: object, pool: cf.ThreadPoolExecutor) -> cf.Future[dict]:
    future = pool.submit(client._call, "POST", "/generate", LONG)  # type: ignore[attr-defined]
    deadline = time.monotonic() + 30
    while client._call("GET", "/get_load")[0]["num_reqs"] == 0:  # type: ignore[attr-defined]
        assert time.monotonic() < deadline and not future.done(), "the request did not start"
        time.sleep(0.01)
    return future


def test_in_place_pause_keeps_requests_and_refuses_flush(server: object) -> None:
    with cf.ThreadPoolExecutor(1) as pool:
        pending = _start_long_request(server, pool)
        server._call("POST", "/pause_generation", {"mode": "in_place"})  # type: ignore[attr-defined]
        assert _flush_status(server) == 400
        server._call("POST", "/continue_generation", {})  # type: ignore[attr-defined]
        reply = pending.result(timeout=120)
    assert reply["meta_info"]["finish_reason"]["type"] == "length" and len(reply["output_ids"]) == NUM_LONG
    assert _flush_status(server) == 200


def test_retract_pause_keeps_requests_and_allows_flush(server: object) -> None:
    with cf.ThreadPoolExecutor(1) as pool:
        pending = _start_long_request(server, pool)
        server._call("POST", "/pause_generation", {"mode": "retract"})  # type: ignore[attr-defined]
        assert _flush_status(server) == 200
        server._call("POST", "/continue_generation", {})  # type: ignore[attr-defined]
        reply = pending.result(timeout=120)
    assert reply["meta_info"]["finish_reason"]["type"] == "length" and len(reply["output_ids"]) == NUM_LONG


def test_abort_pause_ends_requests_and_allows_flush(server: object) -> None:
    with cf.ThreadPoolExecutor(1) as pool:
        pending = _start_long_request(server, pool)
        server._call("POST", "/pause_generation", {"mode": "abort"})  # type: ignore[attr-defined]
        reply = pending.result(timeout=60)
        assert reply["meta_info"]["finish_reason"]["type"] == "abort" and len(reply["output_ids"]) < NUM_LONG
        assert _flush_status(server) == 200


def test_prefix_cache_serves_old_weights_until_flushed(servers: list[object], model_dir: Path) -> None:  # noqa: F811
    """A sync that never flushed would keep serving the old prompt KV: the flush is what makes it exact."""
    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.rollout_adapters.sglang import SglangRollout
    from ckpt_engine.sources.base import StateDictSource

    class NoFlush(SglangRollout):
        """Finalizes as a sync does but skips the flush (flush_cache is false on every bucket)."""

        def finalize(self, version: int) -> None:
            self.client.update_weight_version(str(version))

    client = servers[1]
    config = CheckpointEngineConfig(bucket_size_mb=0.05, timeout_s=60.0)
    session = WeightSyncSession([SglangRollout(client)], config)  # type: ignore[arg-type]
    try:
        t1 = tiny_model(model_dir, seed=41)
        session.sync(StateDictSource(t1), version=1)
        fresh = generate(client)[0]  # fills the prefix cache under t1's weights
    finally:
        session.close()
    unflushed = WeightSyncSession([NoFlush(client)], config)  # type: ignore[arg-type]
    try:
        t2 = tiny_model(model_dir, seed=42)
        unflushed.sync(StateDictSource(t2), version=2)
        stale = generate(client)[0]
        assert _flush_status(client) == 200
        exact = generate(client)[0]
    finally:
        unflushed.close()
    assert exact == greedy(t2) and stale != exact and fresh == greedy(t1)


@pytest.mark.parametrize("mode,finish,version", [("keep", "length", 12), ("abort", "abort", 13)])
def test_sync_during_a_request_flushes_and_keeps_or_ends_it(
    servers: list[object], model_dir: Path, mode: str, finish: str, version: int  # noqa: F811
) -> None:
    """`keep` must let SGLang flush (retract, not in_place), or the sync would fail after the weights landed."""
    from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
    from ckpt_engine.rollout_adapters.sglang import SglangRollout
    from ckpt_engine.sources.base import StateDictSource

    client = servers[1]
    config = CheckpointEngineConfig(bucket_size_mb=0.05, timeout_s=60.0, pause_mode=mode)
    session = WeightSyncSession([SglangRollout(client)], config)  # type: ignore[list-item]
    t = tiny_model(model_dir, seed=60)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = _start_long_request(client, pool)
            assert session.sync(StateDictSource(t), version=version).version == version  # versions never repeat
            reply = pending.result(timeout=120)
    finally:
        session.close()
    assert reply["meta_info"]["finish_reason"]["type"] == finish
    assert generate(client) == (greedy(t), str(version))
