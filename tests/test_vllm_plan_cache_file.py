"""The kept receive plan's file (`vllm/plan_cache.py`) with no engine: a recording made by the dry
run's own tracer round-trips; a torn, changed or foreign file is refused naming what is wrong; the
sample is one layer and everything outside the layers; a tampered landing is found; the directory
follows the environment."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import msgpack
import pytest
import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.vllm import plan_cache
from ckpt_engine.rollout_adapters.vllm.installed import Landing
from ckpt_engine.rollout_adapters.vllm.plan_cache import _first_difference, _read, _write, cache_dir, decode, encode, sample_names
from ckpt_engine.rollout_adapters.vllm.regions import PlanRecording, trace_loader

NAMES = ["model.embed_tokens.weight", *(f"model.layers.{i}.mlp.w.weight" for i in range(3)),
         *(f"model.layers.{i}.norm.weight" for i in range(3)), "model.norm.weight"]


def recording() -> PlanRecording:
    """A two-rank-like loader: the embedding's and each layer's rows 2..4 into fused parameters,
    the norms whole, one copied into a tensor of no layout (unfollowed)."""
    specs = {n: TensorSpec(n, "float32", (4, 4) if n.endswith("w.weight") or "embed" in n else (4,)) for n in NAMES}
    fused = torch.nn.Parameter(torch.empty(2, 4, device="meta"), requires_grad=False)
    norm = torch.nn.Parameter(torch.empty(4, device="meta"), requires_grad=False)
    scratch = torch.empty(2, 4, device="meta")
    rec = PlanRecording(specs)
    rec.targets = {fused.untyped_storage()._cdata: ("fused", fused), norm.untyped_storage()._cdata: ("norm", norm)}

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, w in weights:
            if name == "model.layers.1.mlp.w.weight":
                scratch.copy_(w.narrow(0, 2, 2))
            elif w.dim() == 2:
                fused.copy_(w.narrow(0, 2, 2))
            else:
                norm.copy_(w)

    trace_loader(load, specs, rec)
    rec.targets = {}
    rec.plan()
    return rec


def test_a_recording_round_trips_field_by_field() -> None:
    rec = recording()
    assert rec.landings and rec.unfollowed and rec.touched  # the case covers every field
    back = decode(encode(rec))
    for field in ("boxes", "whole", "computed", "unfollowed", "touched", "landings"):
        assert getattr(back, field) == getattr(rec, field), field
    assert dict(back.specs) == dict(rec.specs)
    assert back.plan().holds == rec.plan().holds
    assert _first_difference(back, rec, NAMES) is None


def _tampered(data: bytes) -> bytes:
    outer = msgpack.unpackb(data)
    body = msgpack.unpackb(outer["payload"])
    body["landings"][0][-1] += 4  # another offset
    outer["payload"] = msgpack.packb(body)
    return msgpack.packb(outer)


@pytest.mark.parametrize("bad, says", [
    (lambda d: d[: len(d) // 2], "not msgpack"),
    (lambda d: b"\xc1" + d, "not msgpack"),
    (_tampered, "checksum does not match"),
    (lambda d: msgpack.packb({"format": 99, "payload": b""}), "format 99"),
    (lambda d: msgpack.packb([1, 2]), "format list"),
])
def test_a_torn_changed_or_foreign_file_is_refused_naming_why(bad: object, says: str, tmp_path: Path) -> None:
    path = tmp_path / "plan-x.msgpack"
    _write(path, bad(encode(recording())))  # type: ignore[operator]
    why = _read(path)
    assert isinstance(why, str) and says in why, why
    assert _read(tmp_path / "absent.msgpack") is None


def test_a_malformed_payload_with_a_good_checksum_is_refused() -> None:
    import hashlib

    payload = msgpack.packb({"boxes": {}, "whole": {}})
    data = msgpack.packb({"format": plan_cache.FORMAT, "sha256": hashlib.sha256(payload).hexdigest(), "payload": payload})
    with pytest.raises(ValueError, match="malformed payload"):
        decode(data)


def test_the_write_leaves_the_whole_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "plan-y.msgpack"
    _write(path, b"first")
    _write(path, encode(recording()))
    assert isinstance(_read(path), PlanRecording)
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_the_sample_is_one_layer_and_every_name_outside_the_layers() -> None:
    seen = set()
    for seed in range(20):
        names, layer = sample_names(NAMES, seed)
        assert layer in (0, 1, 2)
        assert names == [n for n in NAMES if ".layers." not in n or f".layers.{layer}." in n]
        seen.add(layer)
    assert seen == {0, 1, 2}  # processes draw different layers
    assert sample_names(["a", "b"], 0) == (["a", "b"], None)


def test_a_difference_in_the_sample_is_named_and_outside_it_is_not_seen() -> None:
    rec = recording()
    kept = decode(encode(rec))
    first = kept.landings[0]
    kept.landings[0] = Landing(first.name, first.box, first.root, first.target, first.target_shape, first.sizes, first.strides, first.offset + 4)
    why = _first_difference(kept, rec, [first.name])
    assert why is not None and first.name in why and "landings" in why
    outside = [n for n in NAMES if n != first.name]
    assert _first_difference(kept, rec, outside) is None  # what the sample cannot see
    kept = decode(encode(rec))
    kept.whole["model.norm.weight"] = "something else"
    why = _first_difference(kept, rec, NAMES)
    assert why is not None and "model.norm.weight: whole" in why


@pytest.fixture
def fresh_dir() -> Iterator[None]:
    cache_dir.cache_clear()
    yield
    cache_dir.cache_clear()


def test_the_directory_follows_the_environment(fresh_dir: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CKPT_ENGINE_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.setenv("CKPT_ENGINE_CACHE_DIR", str(tmp_path / "other"))
    assert cache_dir() == tmp_path / "c"  # read once
    cache_dir.cache_clear()
    monkeypatch.delenv("CKPT_ENGINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "ckpt_engine"
    cache_dir.cache_clear()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "ckpt_engine"
    cache_dir.cache_clear()
    monkeypatch.setenv("CKPT_ENGINE_PLAN_CACHE", "0")
    assert cache_dir() is None
