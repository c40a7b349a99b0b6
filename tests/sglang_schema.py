"""SGLang's own HTTP request classes, read from its source without importing SGLang.

`import sglang` needs CUDA and a long list of packages, so the contract tests read the two files
that define the HTTP surface from the installed wheel (`scripts/setup.sh` installs
`sglang==0.5.23` without dependencies): `entrypoints/http_server.py` maps each route to its request
class, and `managers/io_struct.py` defines those classes as msgspec structs. The class bodies are
executed on their own (SGLang's code, not a copy of it) so a body is checked the way SGLang's
server parses it: required fields, types and `Literal` values; and, stricter than SGLang (which
drops unknown keys silently), a key SGLang does not know is an error, since a dropped key is a
setting the adapter believes it sent.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
import typing
from functools import cache
from pathlib import Path
from typing import Any

import msgspec

SGLANG_VERSION = "0.5.23"


class SglangSchemaError(ValueError):
    """A request body SGLang's server would refuse, or silently drop a key of."""


@cache
def sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # finds the package; executes nothing of it
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"sglang=={SGLANG_VERSION} is not installed (scripts/setup.sh installs it with --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def _post_routes(tree: ast.Module) -> dict[str, str]:
    """Route -> request class name, from handlers whose first argument is `Annotated[XReqInput, Body()]`."""
    routes: dict[str, str] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or not node.args.args:
            continue
        ann = node.args.args[0].annotation
        if not (isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name) and ann.value.id == "Annotated"):
            continue
        elts = ann.slice.elts if isinstance(ann.slice, ast.Tuple) else [ann.slice]
        if not isinstance(elts[0], ast.Name):
            continue
        for deco in node.decorator_list:
            if (
                isinstance(deco, ast.Call)
                and isinstance(deco.func, ast.Attribute)
                and deco.func.attr in ("post", "api_route")
                and deco.args
                and isinstance(deco.args[0], ast.Constant)
            ):
                routes[deco.args[0].value] = elts[0].id
    return routes


class _Base64Bytes:
    """Stands for SGLang's pydantic marker inside `Annotated[...]`; msgspec ignores the metadata."""


@cache
def _schema() -> tuple[dict[str, str], dict[str, type[msgspec.Struct]]]:
    root = sglang_dir() / "srt"
    routes = _post_routes(ast.parse((root / "entrypoints" / "http_server.py").read_text()))
    source = (root / "managers" / "io_struct.py").read_text()
    tree = ast.parse(source)
    module = types.ModuleType("sglang_io_struct_schema")
    sys.modules[module.__name__] = module
    ns = module.__dict__
    ns.update({n: getattr(typing, n) for n in ("Any", "Annotated", "Dict", "List", "Literal", "Optional", "Tuple", "Union")})
    ns.update(msgspec=msgspec, typing=typing, Base64Bytes=_Base64Bytes)

    class BaseReq(msgspec.Struct, kw_only=True):  # SGLang's base minus its IPC encoding options
        rid: typing.Optional[str] = None
        http_worker_ipc: typing.Optional[str] = None

    BaseReq.__module__ = module.__name__
    ns["BaseReq"] = BaseReq
    wanted = set(routes.values())
    classes: dict[str, type[msgspec.Struct]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in wanted:
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
            if bases != ["BaseReq"]:
                continue  # not a plain request struct; a route using it stays unchecked
            exec(compile(ast.Module(body=[node], type_ignores=[]), str(root / "managers" / "io_struct.py"), "exec"), ns)
            classes[node.name] = ns[node.name]
    return routes, classes


def request_class(route: str) -> type[msgspec.Struct]:
    routes, classes = _schema()
    if route not in routes:
        raise SglangSchemaError(f"SGLang {SGLANG_VERSION} has no POST route {route!r} taking a request body")
    name = routes[route]
    if name not in classes:
        raise SglangSchemaError(f"route {route!r} takes {name}, which is not a plain request struct")
    return classes[name]


def check_body(route: str, body: Any) -> None:
    """Raise SglangSchemaError naming the route and the field if SGLang would refuse or drop part of `body`."""
    cls = request_class(route)
    if not isinstance(body, dict):
        raise SglangSchemaError(f"{route}: the body must be a JSON object, got {type(body).__name__}")
    known = {f.name for f in msgspec.structs.fields(cls)}
    unknown = sorted(set(body) - known)
    if unknown:
        raise SglangSchemaError(f"{route}: {cls.__name__} has no field(s) {unknown} (SGLang would drop them)")
    try:
        msgspec.convert(body, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise SglangSchemaError(f"{route}: {cls.__name__}: {exc}") from exc
