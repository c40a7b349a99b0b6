"""What `vllm/compat.py` decides about vLLM's weight-transfer API, against the API itself: the
installed vLLM (0.32, imported) and vLLM 0.26 read from its wheel (the CPU box cannot import it; the
test skips without the wheel, which `bash bench/vllm_carry.sh fetch` puts in .vllm/wheels/).

Each release's facts: whether the worker engine's base declares `trainer_send_weights` abstract,
whether `LLM` and the dev-mode HTTP routes offer `shutdown_weight_transfer_engine`, whether the
engine keeps a weight version (`get_weight_version`, a version argument to `finish_weight_update`,
`/weight_info`), and whether the trainer API has 0.32's shape (`TrainerInitInfo.backend`).
"""

from __future__ import annotations

import ast
import inspect
import zipfile
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from ckpt_engine.rollout_adapters.vllm.compat import VllmFeatures, features_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WHEELS = ROOT / "bench" / "vllm-wheels-0.26.0.sha256"


def expected(features: VllmFeatures) -> dict[str, bool]:
    return {
        "engine_sends": features.transfer_engine_sends,
        "shutdown": features.transfer_shutdown,
        "versions": features.engine_weight_versions,
        "trainer_api": features.trainer_transfer_api,
    }


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def _abstract(cls: ast.ClassDef) -> set[str]:
    return {name for name, f in _methods(cls).items() if any(isinstance(d, ast.Name) and d.id == "abstractmethod" for d in f.decorator_list)}


def _fields(cls: ast.ClassDef) -> set[str]:
    return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}


@pytest.fixture(scope="module")
def v026() -> dict[str, Any]:
    """vLLM 0.26's weight-transfer base classes, `LLM` and dev-mode RLHF routes, parsed from its wheel."""
    name = next(line.split()[1] for line in WHEELS.read_text().splitlines() if line.split()[1].startswith("vllm-0.26.0-"))
    path = ROOT / ".vllm" / "wheels" / name
    if not path.is_file():
        pytest.skip(f"vLLM 0.26's wheel is not in .vllm/wheels/ ({name}): bash bench/vllm_carry.sh fetch")
    with zipfile.ZipFile(path) as wheel:
        base = _classes(wheel.read("vllm/distributed/weight_transfer/base.py").decode())
        llm = _classes(wheel.read("vllm/entrypoints/llm.py").decode())["LLM"]
        routes = wheel.read("vllm/entrypoints/serve/dev/rlhf/api_router.py").decode()
    return {"base": base, "llm": llm, "routes": routes}


def test_compat_0_26_matches_its_wheel(v026: dict[str, Any]) -> None:
    base, llm, routes = v026["base"], _methods(v026["llm"]), v026["routes"]
    finish_args = [a.arg for a in llm["finish_weight_update"].args.args]
    facts = {
        "engine_sends": "trainer_send_weights" in _abstract(base["WeightTransferEngine"]),
        "shutdown": "shutdown_weight_transfer_engine" in llm and '"/shutdown_weight_transfer_engine"' in routes,
        "versions": "get_weight_version" in llm and "weight_version" in finish_args and '"/weight_info"' in routes,
        "trainer_api": "backend" in _fields(base["TrainerInitInfo"]),
    }
    assert facts == expected(VllmFeatures("0.26.0")) == {"engine_sends": True, "shutdown": False, "versions": False, "trainer_api": False}
    # The worker engine implements every other abstract method of 0.26's base; compat adds the one left there.
    from ckpt_engine.rollout_adapters.vllm.transfer_engine import CkptEngineWeightTransferEngine

    assert _abstract(base["WeightTransferEngine"]) - set(dir(CkptEngineWeightTransferEngine)) == {"trainer_send_weights"}


def test_compat_matches_the_installed_vllm() -> None:
    from vllm import LLM
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, WeightTransferEngine

    from ckpt_engine.rollout_adapters.vllm.transfer_engine import CkptEngineWeightTransferEngine

    facts = {
        "engine_sends": "trainer_send_weights" in WeightTransferEngine.__abstractmethods__,
        "shutdown": hasattr(LLM, "shutdown_weight_transfer_engine"),
        "versions": hasattr(LLM, "get_weight_version") and "weight_version" in inspect.signature(LLM.finish_weight_update).parameters,
        "trainer_api": "backend" in TrainerInitInfo.__annotations__,
    }
    assert facts == expected(features_of())
    assert not CkptEngineWeightTransferEngine.__abstractmethods__  # instantiable on this release
