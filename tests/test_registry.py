"""CheckpointEngineRegistry: lazy built-ins, decorator, entry points, `auto`, clean refusals; a name
maps to a transport, which `new` runs under the pipelined engine (no engine class per transport)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ckpt_engine.pipeline.engine import PipelinedEngine
from ckpt_engine.registry import BackendUnavailableError, CheckpointEngineRegistry
from ckpt_engine.transports.gloo import GlooTransport


def test_import_is_lazy() -> None:
    code = "import sys, ckpt_engine; bad = [m for m in ('vllm', 'torch_npu', 'sglang', 'megatron', 'ckpt_engine.transports.nccl', 'transformers') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.strip() == "[]"


def test_builtins_and_auto_on_cpu() -> None:
    assert {"gloo", "nccl", "hccl", "colocated"} <= set(CheckpointEngineRegistry.names())
    assert CheckpointEngineRegistry.resolve_name("auto", "cpu") == "gloo"
    assert CheckpointEngineRegistry.resolve_name("auto", "cuda") == "nccl"
    assert CheckpointEngineRegistry.resolve_name("auto", "npu") == "hccl"
    assert CheckpointEngineRegistry.get("gloo") is GlooTransport
    engine = CheckpointEngineRegistry.new("gloo", bucket_size_bytes=4096)
    assert isinstance(engine, PipelinedEngine) and isinstance(engine.transport, GlooTransport) and engine.num_buffers == 2
    with pytest.raises(ValueError, match=r"unknown option\(s\) local_senders; allowed: .*delta_scatter_below.*device.*solo_bytes"):
        CheckpointEngineRegistry.new("gloo", bucket_size_bytes=4096, local_senders=[0])  # nccl_handoff's, not gloo's
    for retired in ("num_lanes", "high_priority"):  # variants that measured slower or no faster (docs/transports.md)
        with pytest.raises(ValueError, match=rf"unknown option\(s\) {retired}; allowed: "):
            CheckpointEngineRegistry.new("gloo", bucket_size_bytes=4096, **{retired: 1})


def test_unknown_name_lists_known_backends() -> None:
    with pytest.raises(BackendUnavailableError, match=r"unknown backend 'rdma'; known backends: auto, .*colocated.*gloo.*nccl"):
        CheckpointEngineRegistry.get("rdma")


def test_hccl_refuses_cleanly_without_torch_npu() -> None:
    pytest.importorskip("torch")
    try:
        import torch_npu  # noqa: F401

        pytest.skip("torch_npu is installed here")
    except ImportError:
        pass
    with pytest.raises(BackendUnavailableError, match=r"backend 'hccl' could not be loaded .*torch_npu.*known backends") as info:
        CheckpointEngineRegistry.get("hccl")
    # The failure is remembered and shown when the next lookup fails.
    with pytest.raises(BackendUnavailableError, match=r"failed to import: hccl \(ModuleNotFoundError"):
        CheckpointEngineRegistry.get("nope")
    assert info.value.__cause__ is not None


def test_nccl_refuses_without_cuda() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="needs CUDA"):
        CheckpointEngineRegistry.new("nccl", bucket_size_bytes=4096)


def test_register_decorator_and_duplicates() -> None:
    @CheckpointEngineRegistry.register("test_gloo_copy")
    class Copy(GlooTransport):
        pass

    assert CheckpointEngineRegistry.get("test_gloo_copy") is Copy
    CheckpointEngineRegistry.add("test_gloo_copy", Copy)  # same class again: fine
    with pytest.raises(ValueError, match="already registered"):
        CheckpointEngineRegistry.add("test_gloo_copy", GlooTransport)
    with pytest.raises(ValueError, match="other than 'auto'"):
        CheckpointEngineRegistry.add("auto", Copy)


def test_entry_point_backends(tmp_path: Path) -> None:
    """A third-party package declaring `ckpt_engine.backends` is found without being imported first."""
    pkg = tmp_path / "thirdparty_backend.py"
    pkg.write_text("from ckpt_engine.transports.gloo import GlooTransport\nclass Mine(GlooTransport):\n    name = 'mine'\n")
    dist = tmp_path / "thirdparty_backend-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: thirdparty-backend\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[ckpt_engine.backends]\nmine = thirdparty_backend:Mine\n")
    code = textwrap.dedent(
        f"""
        import sys; sys.path.insert(0, {str(tmp_path)!r})
        from ckpt_engine.registry import CheckpointEngineRegistry as R
        assert 'mine' in R.names(), R.names()
        assert 'thirdparty_backend' not in sys.modules
        print(R.get('mine').__name__, R.new('mine', bucket_size_bytes=4096).name)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "Mine mine"
