"""The delta bench's version generator: chunked AdamW equals AdamW on the whole tensor, bit for
bit; versions kept in files read back equal those kept in memory; a dead bench rank is named;
`bench --delta` end to end on gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckpt_engine.benchmark.rank_exit import RankDied, check_ranks
from ckpt_engine.benchmark.versions import AdamWChain, FileVersions, MemoryVersions
from ckpt_engine.manifest import TensorSpec

SPECS = [TensorSpec("w", "bfloat16", (37, 100)), TensorSpec("norm", "bfloat16", (700,)), TensorSpec("router", "float32", (9, 64))]


def _whole_tensor_versions(chain: AdamWChain, count: int) -> list[list[torch.Tensor]]:
    """The reference: one torch AdamW over each whole tensor, fed the chunks' gradients joined."""
    cpu = torch.device("cpu")
    out: list[list[torch.Tensor]] = [[] for _ in range(count)]
    for i, spec in enumerate(SPECS):
        chunks = chain.chunks(spec)
        master = torch.cat([chain.initial(i, spec, a, b, cpu) for a, b in chunks]).view(spec.shape).requires_grad_(True)
        opt = torch.optim.AdamW([master], lr=chain.lr, weight_decay=0.0)
        steps = chain.warmup_steps + count - 1
        for step in range(steps + 1):
            if step >= chain.warmup_steps:
                out[step - chain.warmup_steps].append(master.detach().to(getattr(torch, spec.dtype)).clone())
            if step < steps:
                master.grad = torch.cat([chain.gradient(i, a, b, step, cpu) for a, b in chunks]).view(spec.shape)
                opt.step()
    return out


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("lr", [1e-6, 1e-4])
def test_chunked_adamw_equals_whole_tensor_adamw(lr: float) -> None:
    # 1 KiB of fp32 state per chunk: 64 elements, rounded up to 256 -> 15, 3 and 3 chunks.
    chain = AdamWChain(lr=lr, chunk_bytes=1024)
    assert [len(chain.chunks(s)) for s in SPECS] == [15, 3, 3]
    count = 4
    store = MemoryVersions(SPECS, count, torch.device("cpu"))
    chain.generate(SPECS, count, torch.device("cpu"), store.sink)
    ref = _whole_tensor_versions(chain, count)
    for v in range(count):
        for got, want in zip(store.versions[v], ref[v]):
            assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want)), f"version {v + 1}"
    # Consecutive versions are real steps: some bf16 words change, most do not at lr 1e-6.
    changed = (_bits(store.versions[1][0]).view(torch.int16) != _bits(store.versions[0][0]).view(torch.int16)).float().mean().item()
    assert 0.0 < changed < (0.5 if lr == 1e-6 else 1.0)


def test_file_versions_equal_memory_versions() -> None:
    chain = AdamWChain(lr=1e-5, chunk_bytes=2048)
    mem = MemoryVersions(SPECS, 3, torch.device("cpu"))
    files = FileVersions(SPECS, chain)
    chain.generate(SPECS, 3, torch.device("cpu"), lambda *a: (mem.sink(*a), files.sink(*a)))
    out = [torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in SPECS]
    for v in (3, 1, 2):
        files.load(v, out)
        assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(out, mem.versions[v - 1]))
    path = files.path
    files.close()
    assert not os.path.exists(path)


def test_bad_settings_named() -> None:
    with pytest.raises(ValueError, match="bad AdamWChain settings"):
        AdamWChain(lr=0.0)
    with pytest.raises(ValueError, match="count must be >= 1"):
        AdamWChain(lr=1e-6).generate(SPECS, 0, torch.device("cpu"), lambda *a: None)


def test_dead_rank_named_with_its_signal() -> None:
    ok = subprocess.Popen([sys.executable, "-c", "pass"])
    ok.wait(timeout=60)
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait(timeout=60)
    with pytest.raises(RankDied, match=r"^rank 1 was killed by SIGKILL \(out of memory\?\)$"):
        check_ranks([ok, killed])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], stderr=subprocess.DEVNULL)
    failed.wait(timeout=60)
    with pytest.raises(RankDied, match=r"^rank 1 exited with code 3$"):
        check_ranks([ok, failed])
    check_ranks([ok])  # all finished well: nothing raised


def test_bench_delta_tiny_end_to_end() -> None:
    """`bench --delta` on real gloo processes: generated versions synced as patches, bit-exact."""
    out = subprocess.run(
        [sys.executable, "-m", "ckpt_engine.cli", "bench", "--delta", "--preset", "tiny", "--layers", "1", "--backend", "gloo",
         "--device", "cpu", "--iters", "1", "--versions", "2", "--lr", "1e-6", "--json", "-"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    s = json.loads(out.stdout)
    assert s["correct"] is True and s["versions_kept"] == "memory"
    for v in ("delta v2", "delta v3"):
        m = s["modes"][v]
        assert 0.0 < m["changed_fraction"] < 0.2 and 0.0 < m["wire_fraction"] < 0.5, m

