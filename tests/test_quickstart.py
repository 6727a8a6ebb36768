"""The "gateway in front of real vLLM engines" commands, on the Quickstart page and in the
README, agree with each other as written: the model name the engines serve
(``vllm serve ... --served-model-name``) is the ``model=`` of every engine
``kvevents serve`` follows, the model of its ``--tokenizer``, and the ``model`` the
client code and curl send; every engine ``kvevents serve`` follows is reached on the
ports the engines publish and serve on (events, replay, OpenAI); the ``kvevents serve``
command loads through the real command-line parser and settings, and the client points
at the port it listens on.

That those commands work against real vLLM engines with the model name set this way
(``--served-model-name`` and ``model=`` equal, the OpenAI client's request through the
gateway) is shown by tests/test_gateway_vllm.py (``test_openai_client``).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", "docs/quickstart.md"]


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def _command(text: str, starts: str) -> list[str]:
    """The one shell command in the page's bash blocks that starts with ``starts``,
    continuation lines joined, as argv."""
    found = []
    for block in _blocks(text, "bash"):
        cmd = ""
        for line in block.splitlines(keepends=True):
            cmd += line
            if line.rstrip("\n").endswith("\\"):
                continue  # a continuation line
            try:
                argv = shlex.split(cmd.replace("\\\n", " "), comments=True)
            except ValueError:  # a quote open across lines (the JSON of --kv-events-config)
                continue
            cmd = ""
            if argv[: len(starts.split())] == starts.split():
                found.append(argv)
    assert len(found) == 1, (starts, found)
    return found[0]


def _flag(argv: list[str], name: str) -> str:
    values = [argv[i + 1] for i, a in enumerate(argv) if a == name]
    assert len(values) == 1, (name, argv)
    return values[0]


@pytest.mark.parametrize("page", PAGES)
def test_quickstart_commands_agree(page):
    from kvevents.cli.main import build_parser
    from kvevents.defaults import DEFAULT_PORT
    from kvevents.service.settings import load_settings

    text = (ROOT / page).read_text()
    vllm = _command(text, "vllm serve")
    served = _flag(vllm, "--served-model-name")
    vllm_port = int(_flag(vllm, "--port"))
    kv = json.loads(_flag(vllm, "--kv-events-config"))
    assert kv["enable_kv_cache_events"] is True and kv["publisher"] == "zmq", kv
    events_port = int(urlsplit(kv["endpoint"]).port)
    replay_port = int(urlsplit(kv["replay_endpoint"]).port)
    # Engines that bind (tcp://*:P): kvevents serve connects to them (no bind=1).
    assert urlsplit(kv["endpoint"]).hostname == "*" and urlsplit(kv["replay_endpoint"]).hostname == "*"

    serve = _command(text, "kvevents serve")
    args = build_parser().parse_args(serve[1:])
    tokenizers = dict(t.split("=", 1) for t in args.tokenizer or [])
    assert list(tokenizers) == [served], (served, tokenizers)
    settings = load_settings(env={}, engines=args.endpoint, port=args.port)
    assert len(settings.engines) >= 2, settings.engines
    for e in settings.engines:
        assert e.model == served and not e.bind, (served, e)
        assert urlsplit(e.endpoint).port == events_port, e
        assert urlsplit(e.replay_endpoint).port == replay_port, e
        http = urlsplit(e.http)
        assert http.port == vllm_port and http.hostname == urlsplit(e.endpoint).hostname, e
    assert settings.port == DEFAULT_PORT

    (client,) = [b for b in _blocks(text, "python") if "OpenAI(" in b]
    assert re.findall(r'model="([^"]+)"', client) == [served], client
    base = urlsplit(re.search(r'base_url="([^"]+)"', client).group(1))
    assert base.port == settings.port and base.path == "/v1", client
    # curl, where the page has it
    for body in re.findall(r"-d '(\{.*?\})'", text, re.S):
        if '"model"' in body:
            assert json.loads(body)["model"] == served, body
