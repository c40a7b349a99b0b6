"""The SGLang adapter's request bodies against SGLang's own request classes (read from its wheel).

The stand-in server (`tests/sglang_standin.py`) applies the same check to every body it receives
in the end-to-end SGLang tests; here each body the client can build is checked directly, and the
check itself is shown to refuse what SGLang would refuse or silently drop.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

import pytest

pytest.importorskip("msgspec")  # a vLLM dependency: always there in CI; the GPU box has no vLLM

from ckpt_engine.manifest import TensorSpec
from ckpt_engine.rollout_adapters.sglang.rollout import _PAUSE_MODES, SglangClient
from sglang_schema import SGLANG_VERSION, SglangSchemaError, check_body, request_class


class _Recording(SglangClient):
    """The real client with its HTTP call replaced by a record of what it would send."""

    def __init__(self) -> None:
        super().__init__("sglang-0", "http://127.0.0.1:1")
        self.sent: list[tuple[str, str, Any]] = []

    def _call(self, method: str, path: str, body: Any = None, timeout_s: float | None = None, probe: bool = False) -> Any:
        self.sent.append((method, path, body))
        return {"weight_version": "0"} if path == "/get_weight_version" else {}


def test_schema_is_sglangs_own() -> None:
    assert version("sglang") == SGLANG_VERSION
    assert request_class("/update_weights_from_distributed").__name__ == "UpdateWeightsFromDistributedReqInput"
    assert request_class("/pause_generation").__name__ == "PauseGenerationReqInput"


@pytest.mark.parametrize(
    ("route", "body", "named"),
    [
        ("/pause_generation", {"mode": "keep"}, "mode"),
        ("/pause_generation", {"mod": "abort"}, "mod"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2, "3"]]}, "shapes"),
        ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["bfloat16"]}, "shapes"),
        ("/init_weights_update_group", {"master_address": "h", "master_port": "1", "rank_offset": 1, "world_size": 2}, "master_port"),
        ("/update_weight_version", {"version": "3"}, "version"),
    ],
)
def test_check_refuses_what_sglang_refuses_or_drops(route: str, body: dict[str, Any], named: str) -> None:
    with pytest.raises(SglangSchemaError, match=named):
        check_body(route, body)


def test_every_body_the_client_builds_is_accepted() -> None:
    client = _Recording()
    specs = [TensorSpec("model.embed_tokens.weight", "bfloat16", (8, 4)), TensorSpec("lm_head.weight", "float32", (8, 4))]
    client.init_weights_update_group("127.0.0.1", 29500, 1, 3, "ckpt-engine-g0", "gloo")
    for flattened in (True, False):
        client.update_weights_from_distributed(specs, "ckpt-engine-g0", flattened=flattened)
    for mode in sorted(set(_PAUSE_MODES.values())):
        client.pause_generation(mode)
    client.continue_generation()
    client.update_weight_version("7")
    client.destroy_weights_update_group("ckpt-engine-g0")
    client.flush_cache()
    posts = [(path, body) for method, path, body in client.sent if method == "POST" and path != "/flush_cache"]
    assert {p for p, _ in posts} == {
        "/init_weights_update_group", "/update_weights_from_distributed", "/pause_generation",
        "/continue_generation", "/update_weight_version", "/destroy_weights_update_group",
    }
    for path, body in posts:
        check_body(path, body)
