"""SGLang: `SglangRollout` (full weights over SGLang's own update routes) and `SglangLoraRollout`
(adapter versions from PEFT folders); docs/sglang.md."""

from ckpt_engine.rollout_adapters.sglang.lora import SglangLoraRollout
from ckpt_engine.rollout_adapters.sglang.rollout import SglangClient, SglangRollout

__all__ = ["SglangClient", "SglangLoraRollout", "SglangRollout"]
