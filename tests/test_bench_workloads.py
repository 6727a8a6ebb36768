"""The chat workloads of ``benchmarks/bench_gateway.py`` (``benchmarks/chat_workloads.py``):
deterministic, shaped as their docstrings say, and the endless-cache bound the benchmark
prints counts only what the engines can reuse (a block of one cache identity never
serves another).

Needs the ``text`` extra's ``transformers`` (the workloads render with the tokenizer's
chat template); skips without it.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

pytest.importorskip("transformers")

from chat_workloads import (AGENT_MAX_PROMPT, TOOL_SET_TOKENS, _Counter, build_agent_workload,  # noqa: E402
                            build_tenant_workload, build_workload, endless_cache_hits,
                            identity_collisions)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from kvevents.demo.chat_templates import TOOLS
    from kvevents.demo.tiny_model import make_tiny_model

    base = make_tiny_model(tmp_path_factory.mktemp("workloads") / "tiny", tokenizer=True)
    tools = tmp_path_factory.mktemp("workloads-tools") / "tiny"
    shutil.copytree(base, tools)
    (tools / "chat_template.jinja").write_text(TOOLS)
    return base, tools


def test_agent_workload_shares_tool_sets_and_fits_the_context(model_dirs):
    _, tools = model_dirs
    reqs = build_agent_workload(24, tools, seed=3)
    assert reqs == build_agent_workload(24, tools, seed=3)  # deterministic
    assert len(reqs) == 24 and all(r.kind == "agent" and r.tools for r in reqs)
    assert all(r.prompt_tokens <= AGENT_MAX_PROMPT for r in reqs)
    count = _Counter(tools)
    sets = {r.tools[0]["function"]["name"].split("_")[0]: r for r in reqs}
    for r in sets.values():  # each tool set's schemas render to at least its size
        system = [r.messages[0]]
        assert count(system, r.tools) - count(system) >= min(TOOL_SET_TOKENS)
    calls = [m for r in reqs for m in r.messages if m.get("tool_calls")]
    results = {m["tool_call_id"] for r in reqs for m in r.messages if m["role"] == "tool"}
    assert calls and {c["tool_calls"][0]["id"] for c in calls} == results  # every call has its result


def test_the_endless_cache_bound_never_shares_blocks_across_identities(model_dirs):
    base, _ = model_dirs
    plain = build_workload(40, base, seed=1)
    tenants = build_tenant_workload(40, base, seed=1)
    assert [r.messages for r in tenants] == [r.messages for r in plain]  # the same prompts
    assert len({(r.model, r.cache_salt) for r in tenants}) > 3
    shared, apart = endless_cache_hits(plain, base), endless_cache_hits(tenants, base)
    assert 0 < apart < shared  # the same text under another identity is no hit
    one = [r for r in tenants if (r.model, r.cache_salt) == (tenants[0].model, tenants[0].cache_salt)]
    assert endless_cache_hits(one, base) == endless_cache_hits(
        [r for r in plain if r.session in {x.session for x in one}], base)


def test_identity_collisions_are_the_text_matched_under_another_identity(model_dirs):
    """On one engine, a text tree's collisions are exactly what the text-only bound
    counts beyond the identity bound; none without identities; and split over two
    engines, only the text sent to the same engine counts."""
    base, _ = model_dirs
    plain = build_workload(40, base, seed=1)
    tenants = build_tenant_workload(40, base, seed=1)
    one_engine = [(i, "e0") for i in range(len(tenants))]
    got = identity_collisions(tenants, one_engine, base)
    assert got["tokens"] == endless_cache_hits(plain, base) - endless_cache_hits(tenants, base) > 0
    assert got["located"] == len(tenants) and 0 < got["requests"] < len(tenants)
    assert identity_collisions(plain, one_engine, base)["tokens"] == 0
    # each identity on an engine of its own: no other identity's text to match
    ident = sorted({(r.model, r.cache_salt) for r in tenants}, key=repr)
    apart = [(i, f"e{ident.index((r.model, r.cache_salt))}") for i, r in enumerate(tenants)]
    assert identity_collisions(tenants, apart, base)["tokens"] == 0
