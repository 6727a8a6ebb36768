"""The ``kvevents`` command as a user meets it: help, version, and one-line errors.

Every usage or configuration error is one line on stderr naming where (flag, variable,
file and field) and the fix, with exit status 2 and no traceback. Run as real processes.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import kvevents
from kvevents.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def kv(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVEVENTS_")}
    return subprocess.run([sys.executable, "-m", "kvevents.cli", *args], cwd=ROOT,
                          env={**base, **(env or {})}, capture_output=True, text=True, timeout=timeout)


def one_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def test_version_is_the_one_version():
    r = kv("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvevents {kvevents.__version__}"


def test_help_is_plain_text_and_every_option_has_help_and_default():
    r = kv("--help")
    assert r.returncode == 0 and "``" not in r.stdout and ":class:" not in r.stdout
    for cmd in ("serve", "tail", "demo", "loadgen"):
        assert cmd in r.stdout
    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        text = sub.format_help()
        assert "``" not in text, name
        for action in sub._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            flag = action.option_strings[-1]
            assert action.help, f"{name} {flag} has no help"
            shown = sub._get_formatter()._expand_help(action)
            if action.nargs != 0 and not action.required:  # takes a value and may be left out
                assert "default" in shown, f"{name} {flag}: no default shown: {shown!r}"
    serve = kv("serve", "--help").stdout
    assert "(default: 8090)" in serve and "KVEVENTS_" in serve and "(default: 127.0.0.1)" in serve


def _config(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_bad_toml_names_the_file_and_position(tmp_path):
    f = _config(tmp_path, "kv.toml", "port = 8090\nhost = \n")
    one_error(kv("serve", "--config", f), "kvevents serve: error: ", f, "invalid TOML", "line 2, column 8")


def test_bad_json_names_the_file_and_position(tmp_path):
    f = _config(tmp_path, "kv.json", '{"port": 8090,\n  "host": }')
    one_error(kv("serve", "--config", f), f"{f}:2:11: invalid JSON")


def test_wrong_type_names_the_field(tmp_path):
    f = _config(tmp_path, "kv.json", '{"port": "eighty"}')
    one_error(kv("serve", "--config", f), f"{f}: field 'port'", "valid integer", "1-65535")


def test_engine_entry_with_a_wrong_key_names_the_key(tmp_path):
    f = _config(tmp_path, "kv.json", '{"engines": [{"name": "a", "endpoint": "tcp://127.0.0.1:1", "replay": "x"}]}')
    one_error(kv("serve", "--config", f), f"{f}: field 'engines'", "unknown key 'replay'", "replay_endpoint")


def test_several_bad_fields_give_one_line_each(tmp_path):
    f = _config(tmp_path, "kv.json", '{"port": 0, "stale_after_s": 0}')
    r = kv("serve", "--config", f)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and "'port'" in lines[0] and "'stale_after_s'" in lines[1], r.stderr


def test_environment_and_flag_errors():
    one_error(kv("serve", env={"KVEVENTS_PORT": "abc"}), "environment variable KVEVENTS_PORT")
    one_error(kv("serve", "--endpoint", "nonsense"), "--endpoint: entry 0: expected NAME=tcp://HOST:PORT")
    one_error(kv("serve", "--port", "x"), "argument --port: invalid int value: 'x'", "kvevents serve --help")
    one_error(kv("serve", "--no-such-flag"), "unrecognized arguments: --no-such-flag")
    one_error(kv("tail", "--endpoint", "udp://127.0.0.1:1", "--duration", "1"), "kvevents tail: error: ")
    one_error(kv(), "the following arguments are required: COMMAND")


@pytest.fixture()
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_serve_port_taken(taken_port):
    one_error(kv("serve", "--port", str(taken_port)), f"--port {taken_port}: cannot listen",
              "pick a free port")


def test_demo_usage_errors(taken_port):
    one_error(kv("demo", "--engines", "0"), "kvevents demo: error: --engines 0: must be > 0")
    one_error(kv("demo", "--port", str(taken_port)), f"--port {taken_port}: the port is in use")
    r = kv("demo", "--engines", "0", "--duration", "-1")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 2, r.stderr


def test_loadgen_usage_errors():
    one_error(kv("loadgen", "--engine", "engine-0=localhost:5560"),
              "--engine 'engine-0=localhost:5560': expected NAME=tcp://HOST:PORT")
    one_error(kv("loadgen", "--engine", "a=tcp://127.0.0.1:1", "--requests", "0"), "--requests 0: must be > 0")


def test_demo_engine_vllm_without_vllm(tmp_path):
    """``--engine vllm`` where vLLM is not importable: one line saying how to install it.

    vLLM is hidden from the real CLI process (``sys.modules['vllm'] = None`` makes
    ``importlib.util.find_spec`` answer None), so this runs with or without it installed."""
    code = ("import runpy, sys; sys.modules['vllm'] = None; "
            "sys.argv = ['kvevents', 'demo', '--engine', 'vllm', '--port', sys.argv[1]]; "
            "runpy.run_module('kvevents.cli', run_name='__main__')")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", code, str(port)], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    one_error(r, "kvevents demo: error: --engine vllm: vLLM is not installed", "make vllm")
    one_error(kv("demo", "--engine", "vllm", "--no-cpu-tier"), "its CPU tier cannot be off")
