"""`ckpt-engine demo checkpoint_engine.weights=adapters`: the demo's LoRA setting, as a user runs it.

A tiny Qwen2 with a PEFT adapter trains a few steps; every sync carries only the adapter into two
reference engines through the daemon, one line per sync; the summary says the engines hold the
trainer's newest adapter bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

TINY = "rollout.model={hidden_size: 128, intermediate_size: 256, num_hidden_layers: 2, num_attention_heads: 2, num_key_value_heads: 1, vocab_size: 512}"


def test_demo_lora_setting_syncs_adapters_only(tmp_path: Path) -> None:
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "ckpt_engine.cli", "demo", "--json", str(out), "checkpoint_engine.weights=adapters",
        "rollout.engine=torch_ref", "trainer.num_processes=1", "trainer.steps=4", "trainer.sync_every=1", "trainer.batch_size=4",
        "trainer.lr=0.01", "trainer.lora={r: 4, lora_alpha: 8, target_modules: [q_proj, v_proj, down_proj]}", TINY,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"demo failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    s = json.loads(out.read_text())
    assert s["weights"] == "adapters" and s["versions"] == [1, 2, 3, 4]
    assert s["engines"] == {"rollout0": 4, "rollout1": 4} and s["exact"] is True
    assert 0 < s["adapter_bytes"] < 0.1 * s["full_bytes"]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("v") and " adapter " in ln]
    assert len(lines) == 4 and all("GB/s" in ln and "install" in ln for ln in lines)
    assert any(ln.startswith("summary:") and ln.endswith("engines hold the trainer's adapter: True") for ln in proc.stdout.splitlines())
