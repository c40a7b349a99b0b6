"""`python -m ckpt_engine.rollout_adapters.torch_ref`: one reference receiver process (`serve.py`)."""

from ckpt_engine.rollout_adapters.torch_ref.serve import main

main()
