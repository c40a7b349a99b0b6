"""Test-only worker extension for test_lora_vllm_tp: what each TP rank's LoRA layers hold
(`_lora_tp_ext`), and the adapter faults of tests/_vllm_installed_faults.py planted on one TP rank
only, so an installed-weight check of the LoRA slots must name that rank.
"""

from __future__ import annotations

from typing import Any

from _lora_tp_ext import LoraTpTestExtension
from _vllm_installed_faults import InstalledFaultsExtension

EXTENSION = "_lora_tp_faults.LoraTpFaultsExtension"


class LoraTpFaultsExtension(LoraTpTestExtension):
    def test_lora_plant_on(self, tp_rank: int, fault: str, module_name: str) -> None:
        """`InstalledFaultsExtension.test_lora_plant` on the worker of TP rank `tp_rank`; nothing elsewhere."""
        from vllm.distributed import get_tensor_model_parallel_rank

        if int(get_tensor_model_parallel_rank()) == tp_rank:
            InstalledFaultsExtension.test_lora_plant(self, fault, module_name)  # type: ignore[arg-type]

    def test_lora_unplant(self) -> None:
        InstalledFaultsExtension.test_lora_unplant(self)  # type: ignore[arg-type]

    def test_lora_state(self) -> dict[str, Any]:
        return InstalledFaultsExtension.test_lora_state(self)  # type: ignore[arg-type]
