"""What SGLang's LoRA route costs on disk: writing a received adapter as a PEFT folder.

`SglangLoraRollout` writes each version as `adapter_model.safetensors` + `adapter_config.json`
(no pickle on the wire; SGLang's `/load_lora_adapter` reads the folder). This times that write (and
a read back through safetensors, about what the server's load does first) for a rank-r LoRA on
every attention and MLP projection of a model's shapes.

    python bench/lora_sglang_folder_bench.py --config ../shared/presets/qwen2.5-7b/config.json --rank 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # a sibling script, run as `python bench/...`
from lora_sync_bench import adapter, module_shapes  # noqa: E402
from ckpt_engine.lora_format import ADAPTER_CONFIG, LoraSpec  # noqa: E402
from ckpt_engine.rollout_adapters.sglang.lora import write_peft_folder  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    from safetensors.torch import load_file

    cfg = json.loads(Path(args.config).read_text())
    tensors = adapter(module_shapes(cfg, cfg["num_hidden_layers"]), args.rank, 0)
    spec = LoraSpec.decode(tensors.pop(ADAPTER_CONFIG))
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    writes, reads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            folder = Path(tmp) / f"engine-v{i}"
            t0 = time.perf_counter()
            write_peft_folder(folder, tensors, spec)
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load_file(str(folder / "adapter_model.safetensors"))
            reads.append(time.perf_counter() - t0)
    w, r = statistics.median(writes), statistics.median(reads)
    print(f"adapter {len(tensors)} tensors, {nbytes / 2**20:.1f} MiB (rank {args.rank}, {cfg['num_hidden_layers']} layers)")
    print(f"write PEFT folder: median {w * 1000:.1f} ms ({nbytes / w / 1e9:.2f} GB/s) over {args.repeats}")
    print(f"read back (safetensors): median {r * 1000:.1f} ms ({nbytes / r / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
