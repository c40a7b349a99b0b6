"""CheckpointEngineRegistry: backend name -> transport, loaded lazily; `new` builds the engine.

A name maps to a `Transport` class, which `new` runs under the one pipelined engine
(`PipelinedEngine`), or, for a wire of its own that the pipeline cannot speak (SGLang's), to a
whole `CheckpointEngine` class. Built-ins are registered by module path so `import ckpt_engine`
never imports torch_npu, CUDA libraries or other optional packages; third-party backends come
from the entry-point group `ckpt_engine.backends` or from the `register` decorator.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from ckpt_engine.engine import CheckpointEngine
    from ckpt_engine.transports.transport import Transport

    Backend = type[Transport] | type[CheckpointEngine]

__all__ = ["CheckpointEngineRegistry", "BackendUnavailableError", "LazyRegistry", "detect_device_type"]

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "ckpt_engine.backends"  # the published group name (third-party packages declare it)


class BackendUnavailableError(ValueError):
    """The backend name is unknown, or its module failed to import."""


def detect_device_type() -> str:
    """'npu' when torch_npu sees an Ascend device, 'cuda' when CUDA does, else 'cpu'."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torch_npu") is not None:
        try:
            import torch_npu  # noqa: F401

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return "npu"
        except Exception as exc:  # a broken torch_npu must not hide CUDA or CPU
            logger.warning("torch_npu is installed but failed to load: %s", exc)
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


AUTO_BY_DEVICE = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


class LazyRegistry:
    """A process-wide table of names: built-ins by 'module:attr' path, imported on first use;
    third parties by entry point (`group`) or `add`. Subclasses name what they hold (`what`) and
    their error; the backends below and the daemon's engine kinds are the two."""

    what: ClassVar[str]
    group: ClassVar[str]
    error: ClassVar[type[ValueError]] = ValueError
    reserved: ClassVar[tuple[str, ...]] = ()
    """Names a lookup takes besides the registered ones (backends: `auto`); never registered."""
    _lazy: ClassVar[dict[str, str]]
    _classes: ClassVar[dict[str, Any]]
    _failed: ClassVar[dict[str, str]]
    _entry_points_loaded: ClassVar[bool] = False

    @classmethod
    def add(cls, name: str, obj: Any) -> None:
        """Register `obj`, or a 'module:attr' path to import on first use, under `name`."""
        if not isinstance(name, str) or not name or name in cls.reserved:
            other = f" other than {', '.join(map(repr, cls.reserved))}" if cls.reserved else ""
            raise ValueError(f"{cls.what} name must be a non-empty string{other}, got {name!r}")
        current = cls._classes.get(name, cls._lazy.get(name))
        if current is not None:
            if current == obj:
                return
            raise ValueError(f"{cls.what} {name!r} is already registered; registered: {', '.join(cls.names())}")
        if isinstance(obj, str):
            cls._lazy[name] = obj
        else:
            cls._classes[name] = obj
            cls._lazy.pop(name, None)
        cls._failed.pop(name, None)

    @classmethod
    def _load_entry_points(cls) -> None:
        if cls._entry_points_loaded:
            return
        cls._entry_points_loaded = True
        try:
            for ep in entry_points(group=cls.group):
                if ep.name not in cls._lazy and ep.name not in cls._classes:
                    cls._lazy[ep.name] = ep.value
        except Exception as exc:  # a broken third-party distribution must not break the built-ins
            logger.warning("could not read the %s entry points: %s", cls.group, exc)

    @classmethod
    def names(cls) -> list[str]:
        cls._load_entry_points()
        return sorted(set(cls._lazy) | set(cls._classes))

    @classmethod
    def get(cls, name: str) -> Any:
        """What `name` is registered as, importing it if needed."""
        cls._load_entry_points()
        if name in cls._classes:
            return cls._classes[name]
        target = cls._lazy.get(name)
        if target is None:
            raise cls.error(cls._unknown_message(name))
        module_name, _, attr = target.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except Exception as exc:
            cls._failed[name] = f"{type(exc).__name__}: {exc}"
            raise cls.error(f"{cls.what} {name!r} could not be loaded from {target}: {cls._failed[name]}. {cls._unknown_message(None)}") from exc
        cls._classes[name] = obj
        return obj

    @classmethod
    def _unknown_message(cls, name: str | None) -> str:
        head = f"unknown {cls.what} {name!r}; " if name is not None else ""
        msg = f"{head}known {cls.what}s: {', '.join([*cls.reserved, *cls.names()])}"
        if cls._failed:
            msg += "; failed to import: " + "; ".join(f"{k} ({v})" for k, v in sorted(cls._failed.items()))
        return msg


class CheckpointEngineRegistry(LazyRegistry):
    """Process-wide table of transport backends."""

    what = "backend"
    group = ENTRY_POINT_GROUP
    error = BackendUnavailableError
    reserved = ("auto",)
    _lazy: ClassVar[dict[str, str]] = {
        "gloo": "ckpt_engine.transports.gloo:GlooTransport",
        "nccl": "ckpt_engine.transports.nccl:NcclTransport",
        "hccl": "ckpt_engine.transports.hccl:HcclTransport",
        "colocated": "ckpt_engine.transports.colocated:ColocatedTransport",
        "nccl_handoff": "ckpt_engine.transports.handoff:HandoffTransport",
    }
    _classes: ClassVar[dict[str, Backend]] = {}
    _failed: ClassVar[dict[str, str]] = {}

    @classmethod
    def register(cls, name: str) -> Callable[[Backend], Backend]:
        """Class decorator: `@CheckpointEngineRegistry.register("mybackend")` on a `Transport`."""

        def deco(engine_cls: Backend) -> Backend:
            cls.add(name, engine_cls)
            return engine_cls

        return deco

    @classmethod
    def resolve_name(cls, name: str, device_type: str | None = None) -> str:
        if name != "auto":
            return name
        return AUTO_BY_DEVICE[device_type if device_type is not None else detect_device_type()]

    @classmethod
    def get(cls, name: str) -> Backend:
        """The transport (or whole engine) class for `name` ('auto' picks by device), importing it
        if needed."""
        backend: Backend = super().get(cls.resolve_name(name))
        return backend

    @classmethod
    def new(cls, name: str, **kwargs: Any) -> CheckpointEngine:
        """The engine of backend `name`: the pipelined engine over its transport (`kwargs`: the
        engine's arguments and options, `PipelinedEngine`), or its own engine class."""
        from ckpt_engine.pipeline.engine import PipelinedEngine
        from ckpt_engine.transports.transport import Transport

        backend = cls.get(name)
        if issubclass(backend, Transport):
            return PipelinedEngine(backend, **kwargs)
        return backend(**kwargs)

    @classmethod
    def check_options(cls, name: str, options: dict[str, Any]) -> None:
        """Refuse, by name, an option backend `name` does not take or a value it would refuse when
        built (ValueError); nothing is allocated. A whole engine checks its own when built."""
        from ckpt_engine.pipeline.options import split_options
        from ckpt_engine.transports.transport import Transport

        backend = cls.get(name)
        if issubclass(backend, Transport):
            split_options(backend, options)
