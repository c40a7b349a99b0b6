"""A reference receiver whose loader plants one fault (issue 42 item 5), run as its own process:
`main(["transpose:NAME" | "skip:NAME", *torch_ref_args])`. `transpose` writes NAME's bytes in
transposed order (a loader that transposes once too often), `skip` never writes NAME (a loader
that drops a tensor): both on whole-tensor and region loads, live or into a staging copy."""

from __future__ import annotations

from typing import Any

import torch

from ckpt_engine.rollout_adapters.torch_ref import serve, worker as ref_worker


def _fault(kind: str, target: str, name: str, t: torch.Tensor) -> torch.Tensor | None:
    if name != target:
        return t
    if kind == "skip":
        return None
    return t.reshape(t.shape[0], -1).t().contiguous().view(t.shape)  # same shape, bytes transposed


def main(argv: list[str]) -> None:
    kind, target = argv[0].split(":", 1)
    worker = ref_worker.TorchRefWorker
    load_bucket, load_regions = worker.load_bucket, worker.load_regions

    def faulty_bucket(self: Any, pairs: list[tuple[str, torch.Tensor]], *a: Any, **kw: Any) -> int:
        kept = [(n, f) for n, t in pairs for f in (_fault(kind, target, n, t),) if f is not None]
        return load_bucket(self, kept, *a, **kw)

    def faulty_regions(self: Any, items: list[tuple[str, Any, torch.Tensor]], *a: Any, **kw: Any) -> int:
        kept = [(n, r, f) for n, r, t in items for f in (_fault(kind, target, n, t),) if f is not None]
        return load_regions(self, kept, *a, **kw)

    worker.load_bucket, worker.load_regions = faulty_bucket, faulty_regions  # type: ignore[method-assign]
    serve.main(argv[1:])
