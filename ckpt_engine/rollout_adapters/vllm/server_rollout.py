"""The vLLM handle over a dev-mode `vllm serve`'s HTTP routes."""

from __future__ import annotations

from typing import Any

from ckpt_engine.rollout_adapters.vllm.clients import http_channel
from ckpt_engine.rollout_adapters.vllm.rollout import VllmRollout

__all__ = ["VllmServerRollout"]


class VllmServerRollout(VllmRollout):
    """`VllmRollout` over the HTTP routes of `python -m vllm.entrypoints.openai.api_server
    --worker-extension-cls ...` in dev mode, at `base_url`. `session`: the `requests.Session` for
    the control calls; `world_size`: spares asking the server."""

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        timeout_s: float = 300.0,
        world_size: int | None = None,
        session: Any = None,
        staging_limit_bytes: int | None = None,
    ) -> None:
        client, workers = http_channel(name, base_url, timeout_s, session, world_size)
        super().__init__(name, client, timeout_s=timeout_s, staging_limit_bytes=staging_limit_bytes, world_size=workers)
        self.base_url, self.http = client.base_url, client.http
