"""The recorder's dry run on a toy `load_weights` (no vLLM): what each kind of loader op records."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.planning.regions import Region
from ckpt_engine.rollout_adapters.vllm.regions import trace_loader


def meta(*shape: int) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def test_trace_records_regions_fallbacks_and_absences() -> None:
    specs = {
        "q": TensorSpec("q", "float32", (8, 4)),
        "k": TensorSpec("k", "float32", (4, 4)),
        "o": TensorSpec("o", "float32", (4, 8)),
        "norm": TensorSpec("norm", "float32", (4,)),
        "scaled": TensorSpec("scaled", "float32", (4, 4)),
        "late": TensorSpec("late", "float32", (4, 4)),
        "item": TensorSpec("item", "float32", (4,)),
        "gate_up": TensorSpec("gate_up", "float32", (8, 4)),
        "other_expert": TensorSpec("other_expert", "float32", (4, 4)),
        "after": TensorSpec("after", "float32", (6, 4)),
    }
    qkv, o, norm, x = meta(6, 4), torch.nn.Parameter(meta(4, 4), requires_grad=False), meta(4), meta(2, 4)
    written: list[str] = []

    def load(weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for name, w in weights:
            assert isinstance(w.shape, torch.Size) and w.shape.numel() == w.numel()
            if name == "q":  # a TP rank's rows: narrow, then copy_ into its slot
                qkv[0:4].copy_(w.narrow(0, 4, 4))
            elif name == "k":  # GQA: chunk by head, the second one, assigned by index
                qkv[4:6] = w.chunk(2, dim=0)[1]
            elif name == "o":  # a column shard, the parameter's data replaced
                o.data = w[:, 4:8]
            elif name == "norm":
                norm.copy_(w)
            elif name == "scaled":  # arithmetic over the whole tensor before slicing
                x.copy_((w * 2.0).narrow(0, 0, 2))
            elif name == "late":  # arithmetic after slicing keeps the region
                x.copy_(w.narrow(0, 2, 2) * 2.0)
            elif name == "item":  # needs data: raises on a placeholder
                norm.fill_(float(w[0]))
            elif name == "gate_up":  # a fused tensor: two reads of one name
                x.copy_(w[2:4])
                x.copy_(w[6:8])
            elif name == "other_expert":  # another EP rank's: never touched
                continue
            elif name == "after":  # still reached after the failing loader
                x.copy_(w.t()[:, 4:6].t())
            written.append(name)
        return set(written)

    rec = trace_loader(load, specs)
    plan = rec.plan()
    assert plan.holds == {
        "q": (Region(0, 4, 4),),
        "k": (Region(0, 2, 2),),
        "o": (Region(1, 4, 4),),
        "norm": None,
        "scaled": None,
        "late": (Region(0, 2, 2),),
        "item": None,
        "gate_up": (Region(0, 2, 2), Region(0, 6, 2)),
        "after": (Region(0, 4, 2),),
    }
    assert set(rec.whole) == {"scaled", "item"}
    assert "reads the whole tensor" in rec.whole["scaled"] and "raised" in rec.whole["item"]
    plan.check(specs.values())
    # nothing was written: the meta destinations are untouched and `o` keeps its own data
    assert o.shape == (4, 4)
