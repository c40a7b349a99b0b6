"""`SyncReport.wire_bytes` of a dense sync with receive plans (issue 42 item 3): the bytes the
senders put on the wire, i.e. every piece once per receiver set it travels to, so a checkpoint
tensor no engine rank holds is not counted (it was: the report said the whole checkpoint's bytes).

Two reference receivers in their own processes, the TP=2 ranks of a Qwen2-shaped engine that ties
its embeddings: its model has no `lm_head.weight` and, as vLLM's Qwen2 loader does under
`tie_word_embeddings`, it takes a checkpoint that has one and never loads it. Its plans leave the
head out, so no rank receives it.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine import CheckpointEngineConfig, WeightSyncSession
from ckpt_engine.rollout_adapters import receiver
from ckpt_engine.rollout_adapters.torch_ref import serve
from ckpt_engine.rollout_adapters.torch_ref import TorchRefRollout, write_spec_file
from ckpt_engine.sources.base import StateDictSource
from helpers_procs import fork_program
from regionranks import KV_HEADS, qwen2_specs, weights

pytestmark = pytest.mark.timeout(300)

UNHELD = "lm_head.weight"
"""In the trainer's checkpoint, not in the engine's model (tied embeddings): no rank receives it."""
TIMEOUT_S = 30.0


def tied_main(argv: list[str]) -> None:
    """A reference receiver that accepts a manifest naming `UNHELD` (and holds no such tensor)."""
    check = receiver.check_manifest_against

    def skipping_the_head(manifest: Any, expected: Any) -> list[str]:
        return [p for p in check(manifest, expected) if not p.startswith(f"{UNHELD}: ")]

    receiver.check_manifest_against = skipping_the_head  # type: ignore[assignment]
    serve.main(argv)


def _spawn(name: str, spec_file: str, tp_rank: int) -> TorchRefRollout:
    token = secrets.token_hex(16)
    argv = ["--spec-file", spec_file, "--port", "0", "--tp-size", "2", "--tp-rank", str(tp_rank), "--num-kv-heads", str(KV_HEADS)]
    program = fork_program("test_report_wire_bytes:tied_main", argv, f"engine-{name}", env={serve.TOKEN_ENV: token})
    line = program.read_line(serve.READY_PREFIX, 60)
    assert line is not None, f"engine {name} did not start"
    return TorchRefRollout(name, "127.0.0.1", int(line[len(serve.READY_PREFIX):].strip()), program.process, TIMEOUT_S, token=token)


@pytest.fixture(scope="module")
def tp_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[TorchRefRollout]]:
    path = Path(tmp_path_factory.mktemp("wire")) / "tied.msgpack"
    write_spec_file(path, [s for s in qwen2_specs() if s.name != UNHELD])
    rs = [_spawn(f"tp{r}", str(path), r) for r in range(2)]
    yield rs
    for r in rs:
        r.close()


@pytest.mark.parametrize("delta", ["off", "on"])
def test_wire_bytes_of_a_dense_region_sync_count_only_what_crosses_the_wire(tp_engines: list[TorchRefRollout], delta: str) -> None:
    specs = qwen2_specs()
    model = sum(s.nbytes for s in specs)
    held = model - next(s.nbytes for s in specs if s.name == UNHELD)
    cfg = CheckpointEngineConfig(backend="gloo", bucket_size_mb=0.0625, timeout_s=TIMEOUT_S, delta=delta)
    session = WeightSyncSession(tp_engines, cfg)
    try:
        report = session.sync(StateDictSource(weights(specs, 0)))
    finally:
        session.close()
    assert report.delta == ("off" if delta == "off" else "seed")
    assert report.bytes == model  # the trainer's checkpoint, whatever the engines hold
    # Each TP rank holds half of every split tensor, and both hold the norms, the biases of o/down
    # and the one KV head whole: those shared pieces travel once, to the set of both ranks, so the
    # wire carries every held byte once: less than the ranks' sum, more than either rank's.
    received = [report.received_bytes[f"tp{r}"][0] for r in range(2)]
    if delta == "off":  # the tensor bytes sent
        assert report.wire_bytes == held, (report.wire_bytes, held, model)
    else:  # a seed counts its dense frames: whole buckets, the alignment between chunks included
        assert held <= report.wire_bytes < model, (report.wire_bytes, held, model)
    assert max(received) < report.wire_bytes < sum(received)
    assert report.dense_bytes == report.wire_bytes and report.wire_bytes_per_sender == [report.wire_bytes]
    assert [report.receivers[f"tp{r}"]["bytes"] for r in range(2)] == received
