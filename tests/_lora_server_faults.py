"""Test-only worker extension for tests/test_lora_vllm_server.py: the adapter faults of
tests/_vllm_installed_faults.py, plus a vLLM whose registration does not activate the adapter.

vLLM 0.32's `/v1/load_lora_adapter` activates the adapter it adds (the LRU worker manager's
`add_adapter`), so the slot check runs inside the registration. A vLLM that only adds it activates
it at the first request naming it; `test_lora_lazy_registration` makes the next registration do
that, so the handle's one `max_tokens=1` completion is what activates the version to be checked.
"""

from __future__ import annotations

from typing import Any

from _vllm_installed_faults import InstalledFaultsExtension

EXTENSION = "_lora_server_faults.LoraServerFaultsExtension"


class LoraServerFaultsExtension(InstalledFaultsExtension):
    def test_lora_lazy_registration(self) -> None:
        """The next `add_adapter` of this worker's LoRA manager loads and adds the adapter without
        activating it (later calls: vLLM's own, as hooked by ckpt-engine)."""
        manager = self.model_runner.lora_manager  # type: ignore[attr-defined]

        def add_only(request: Any) -> bool:
            vars(manager).pop("add_adapter", None)
            if request.lora_int_id in manager.list_adapters():
                return False
            return bool(manager._adapter_manager.add_adapter(manager._load_adapter(request)))

        manager.add_adapter = add_only
        self._lora_planted = [*getattr(self, "_lora_planted", []), (manager, "add_adapter", None)]
