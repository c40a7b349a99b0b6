"""Bad input on the command line and in job YAML: one line naming the field or flag and what it
accepts, a non-zero exit, never a traceback (issue 10, item 9).

Runs `ckpt_engine.cli.main` in this process (an escaping exception fails the test just as a
traceback would). (`ckpt-engine serve` and `status` as commands: tests/test_daemon_protocol.py.)
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from ckpt_engine.cli import main

pytestmark = pytest.mark.timeout(120)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's exit
        rc = exc.code if isinstance(exc.code, int) else 1
    err = capsys.readouterr().err
    return rc, err


@pytest.fixture(scope="module")
def yaml_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    d = tmp_path_factory.mktemp("bad_yaml")
    files = {
        "syntax": "checkpoint_engine:\n  backend: [gloo\n",
        "list_section": "checkpoint_engine: [1, 2]\n",
        "tab": "checkpoint_engine:\n\tbackend: gloo\n",
    }
    out = {}
    for name, text in files.items():
        path = d / f"{name}.yaml"
        path.write_text(text)
        out[name] = str(path)
    return out


CASES = [
    # (argv, words the one line must contain)
    (["serve", "checkpoint_engine=5"], ["checkpoint_engine must be a mapping"]),
    (["serve", "checkpoint_engine.engine_kwargs.gloo.bogus_opt=1"], ["engine_kwargs.gloo", "bogus_opt", "allowed: ", "solo_bytes"]),
    (["serve", "checkpoint_engine.engine_kwargs.warp=1"], ["engine_kwargs must map backend names"]),
    (["serve", "checkpoint_engine.engine_kwargs.warp.x=1"], ["engine_kwargs.warp", "not a backend", "allowed: "]),
    (["serve", "checkpoint_engine.timeout_s=.inf"], ["checkpoint_engine.timeout_s", "(0, 604800]"]),
    (["serve", "checkpoint_engine.timeout_s=.nan"], ["checkpoint_engine.timeout_s", "(0, 604800]"]),
    (["serve", "daemon.handshake_timeout_s=.inf"], ["daemon.handshake_timeout_s", "finite"]),
    (["serve", "daemon.port=70000"], ["daemon.port", "[0, 65535]"]),
    (["serve", "checkpoint_engine.backend=[1"], ["override", "not a YAML"]),
    (["serve", "--port", "70000"], ["--port", "[0, 65535]"]),
    (["serve", "--port", "-1"], ["--port", "[0, 65535]"]),
    (["serve", "--token", "short"], ["--token", "at least 8"]),
    (["serve", "--log-level", "FOO"], ["--log-level", "'FOO'", "INFO"]),
    (["serve", "checkpoint_engin.backend=nccl"], ["unknown section 'checkpoint_engin'", "did you mean 'checkpoint_engine'"]),
    (["serve", "deamon.port=5"], ["unknown section 'deamon'", "did you mean 'daemon'"]),
    (["bench", "--bucket-mb", "-1"], ["--bucket-mb", "> 0"]),
    (["bench", "--bucket-mb", "0"], ["--bucket-mb", "> 0"]),
    (["bench", "--solo-mb", "-1"], ["--solo-mb", ">= 0"]),
    (["bench", "--timeout-s", "0"], ["--timeout-s", "(0, 604800]"]),
    (["bench", "--layers", "-1"], ["--layers", ">= 1"]),
    (["bench", "--buffers", "1"], ["--buffers", ">= 2"]),
    (["bench", "--modes", "raw,warp"], ["--modes", "warp", "allowed: raw"]),
    (["bench", "--preset", "gpt-17"], ["unknown preset 'gpt-17'", "tiny"]),
    (["status", "--address", "127.0.0.1:9", "--token", "abcdefgh", "--timeout-s", "0"], ["--timeout-s", "(0, 604800]"]),
    (["status", "--address", "nowhere", "--token", "abcdefgh"], ["--address", "host:port"]),
    (["demo", "checkpoint_engine.bucket_size_mb=1048576"], ["checkpoint_engine.bucket_size_mb=1048576", "GiB free", "at most"]),
    (["demo", "checkpoint_engine=5"], ["checkpoint_engine must be a mapping"]),
    (["demo", "checkpoint_engine.timeout_s=.inf"], ["checkpoint_engine.timeout_s", "(0, 604800]"]),
]


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_bad_flags_and_overrides_get_one_line(argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    rc, err = run(argv, capsys)
    assert rc != 0, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.mark.parametrize("which,words", [
    ("syntax", ["not valid YAML", "line 3"]),
    ("list_section", ["checkpoint_engine must be a mapping", "list"]),
    ("tab", ["not valid YAML", "line 2"]),
])
def test_bad_yaml_files_get_one_line(which: str, words: list[str], yaml_files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    for command in ("serve", "demo"):
        rc, err = run([command, "--config", yaml_files[which]], capsys)
        lines = err.strip().splitlines()
        assert rc != 0 and len(lines) == 1 and "Traceback" not in err, err
        if "YAML" in words[0]:
            assert yaml_files[which] in lines[0]
        for w in words:
            assert w in lines[0], (w, lines[0])


def test_serve_on_a_taken_port_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        rc, err = run(["serve", "--port", str(port)], capsys)
    finally:
        taken.close()
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "--port" in lines[0] and str(port) in lines[0] and "in use" in lines[0]


def test_paths_and_files_that_cannot_serve_get_one_line_before_anything_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A results, token or version-state path in a folder that does not exist, a model config that is not one:
    refused in one line before the daemon listens or a bench rank starts (they were tracebacks,
    the bench's after its whole run)."""
    missing = tmp_path / "no-such-folder"
    model = {"list": "[1, 2]", "sizes": '{"model_type": "qwen2", "vocab_size": 10}',
             "negative": '{"model_type": "qwen2", "hidden_size": -64, "vocab_size": 100, "num_hidden_layers": 2}'}
    for name, text in model.items():
        (tmp_path / f"{name}.json").write_text(text)
    blocker = tmp_path / "a-file"
    blocker.write_text("where --out-dir would make a folder")
    cases = [
        (["serve", "--token-file", str(missing / "token")], ["--token-file", "No such file"]),
        (["serve", f"daemon.state_file={missing / 'versions.json'}"], ["daemon.state_file", "does not exist"]),
        (["bench", "--preset", "tiny", "--json", str(missing / "out.json")], ["--json", "No such file"]),
        (["plan", "--model", str(tmp_path / "list.json")], ["--model", "one JSON object, not a list"]),
        (["plan", "--model", str(tmp_path / "sizes.json")], ["--model", "lacks hidden_size, num_hidden_layers"]),
        (["plan", "--model", str(tmp_path / "negative.json")], ["--model", "hidden_size must be a whole number >= 1, got -64"]),
        (["plan", "--sweep", "bucket_mb=64,128", "--out-dir", str(blocker / "sub")], ["cannot write the results"]),
    ]
    if not torch.cuda.is_available():
        cases.append((["bench", "--device", "cuda"], ["--device cuda", "no CUDA device"]))
    for argv, words in cases:
        rc, err = run(argv, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (argv, rc, err)
        for w in words:
            assert w in lines[0], (argv, w, lines[0])
    assert not missing.exists()
