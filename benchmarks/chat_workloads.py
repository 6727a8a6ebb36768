"""The chat workloads of ``bench_gateway.py`` (deterministic for a seed, in the tiny
tokenizer's own words, so prompts tokenize as they would in a real model's vocabulary).

* :func:`build_workload` ("chats"): shared system prompts (300-600 tokens), growing
  multi-turn conversations and users revisiting long documents (~800 tokens).
* :func:`build_agent_workload` ("agent"): tool-using agents. Four tool sets of 1.5k,
  1.65k, 1.85k and 2k tokens of JSON schemas (nested objects, enums), each with its
  own system prompt, used by 4:3:2:1 of the sessions; a session is a task, then turns
  of an assistant tool call (arguments as JSON) and the tool's result, now and then an
  answer and a follow-up question. Rendered with a template that prints the tool
  schemas in the system turn (:data:`kvevents.demo.chat_templates.TOOLS`), so every
  conversation of a tool set shares its 1-2k-token prefix, and a router whose ids lack
  the tools matches nothing past the system prompt.

* :func:`build_tenant_workload` ("tenants"): the chats, each session under one of seven
  cache identities that share the same system prompts and documents: three LoRA
  adapters (``"model": "<adapter>"``) and four tenants of the base model, each with its
  own ``cache_salt``. vLLM never reuses one identity's blocks for another, so a router
  that matches text alone counts hits the engines do not give.

Each request carries the whole conversation so far; a session's turns are sent one
after the other by the client.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

MAX_PROMPT = 1400  # prompt tokens at most (the chats' engines: max_model_len 1504, minus max_tokens and margin)
AGENT_MAX_PROMPT = 3900  # the agent workload's (its engines: max_model_len 4096)
TOOL_SET_TOKENS = (1100, 1400, 1700, 2000)  # each tool set's schemas rendered, at least (one tool more)
TOOL_SET_WEIGHTS = (4, 3, 2, 1)  # sessions per tool set
ACTIVE_SESSIONS = 12  # sessions under way at a time


@dataclass
class ChatRequest:
    index: int  # position in the workload's order
    session: str  # turns of one session are sent one after the other
    kind: str  # "chat" (a conversation turn), "doc" (a document question), "agent" (a tool-using turn)
    messages: list[dict]
    max_tokens: int
    prompt_tokens: int  # as this generator counts them (rendered template)
    tools: list[dict] | None = None  # the request's tool schemas (sent with tool_choice "none")
    model: str | None = None  # a LoRA adapter's name (None: the base model)
    cache_salt: str | None = None  # the tenant's salt (vLLM keys the first block with it)


class _Text:
    """Deterministic filler text in the tiny tokenizer's own words (~1.1 tokens a word)."""

    def __init__(self, rng: random.Random) -> None:
        from kvevents.demo.tiny_model import _SYLLABLES

        self.rng = rng
        self.words = [a + b for a in _SYLLABLES for b in _SYLLABLES]

    def words_for(self, tokens: int) -> int:
        return max(1, int(tokens / 1.12))

    def text(self, tokens: int) -> str:
        out = []
        for i in range(self.words_for(tokens)):
            w = self.rng.choice(self.words)
            out.append(w + "." if self.rng.random() < 0.08 else w)
        return " ".join(out)


class _Counter:
    """Prompt tokens of a message list, rendered with the model's chat template."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))

    def __call__(self, messages: list[dict], tools: list[dict] | None = None) -> int:
        return len(self.ids(messages, tools))

    def ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """The chat's prompt ids, as vLLM renders and tokenizes a chat."""
        text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]


def _interleave(n: int, rng: random.Random, new_session: Callable[[int], dict],
                turn: Callable[[dict, int], ChatRequest | None]) -> list[ChatRequest]:
    """``n`` requests: ``ACTIVE_SESSIONS`` sessions under way at a time, each request the
    next turn of a random one (``turn(session, index)``; None: the conversation would
    outgrow the context, and it ends there); a session that has had its ``turns`` or
    ended makes room for a new one (``new_session(k)``)."""
    out: list[ChatRequest] = []
    active: list[dict] = []
    started = 0
    while len(out) < n:
        while len(active) < ACTIVE_SESSIONS:
            active.append(new_session(started))
            started += 1
        s = rng.choice(active)
        req = turn(s, len(out))
        if req is None:
            active.remove(s)
            continue
        out.append(req)
        s["done"] += 1
        if s["done"] >= s["turns"]:
            active.remove(s)
    return out


def build_workload(n: int, model_dir: Path, seed: int = 0, max_prompt: int = MAX_PROMPT) -> list[ChatRequest]:
    """``n`` requests in order (see the module docstring): ~12 sessions active at a time,
    each turn of a random active one next; a finished session makes room for a new one.
    Two in three sessions are conversations, one in three a document question."""
    rng = random.Random(seed)
    text = _Text(rng)
    count = _Counter(model_dir)
    systems = [f"You are assistant {i}. " + text.text(rng.randint(300, 600)) for i in range(4)]
    sys_weights = [8, 4, 2, 1]  # a few popular system prompts
    docs = [f"Document {i}.\n" + text.text(rng.randint(720, 880)) for i in range(6)]
    doc_system = "You answer questions about the document the user gives. " + text.text(40)
    doc_weights = [6, 4, 3, 2, 1, 1]

    def new_session(k: int) -> dict:
        if rng.random() < 2 / 3:
            system = rng.choices(systems, sys_weights)[0]
            return {"name": f"chat-{k}", "kind": "chat", "turns": rng.randint(3, 7),
                    "messages": [{"role": "system", "content": system}], "done": 0}
        return {"name": f"doc-{k}", "kind": "doc", "turns": rng.randint(1, 3),
                "doc": rng.choices(docs, doc_weights)[0], "done": 0}

    def turn(s: dict, index: int) -> ChatRequest | None:
        max_tokens = rng.randint(8, 16)
        if s["kind"] == "chat":
            if s["done"]:  # the previous answer, then a new user message
                s["messages"].append({"role": "assistant", "content": text.text(rng.randint(30, 80))})
            s["messages"].append({"role": "user", "content": text.text(rng.randint(40, 120))})
            messages = [dict(m) for m in s["messages"]]
        else:  # each question a fresh request on the same document (a revisit)
            messages = [{"role": "system", "content": doc_system},
                        {"role": "user", "content": s["doc"] + "\n\nQuestion: " + text.text(rng.randint(15, 40))}]
        tokens = count(messages)
        if tokens > max_prompt:
            return None
        return ChatRequest(index, s["name"], s["kind"], messages, max_tokens, tokens)

    return _interleave(n, rng, new_session, turn)


def _tool(text: _Text, name: str) -> dict:
    """One function's schema (about 150-300 tokens rendered): 3-6 parameters, one of them
    a nested object now and then."""
    rng = text.rng
    props: dict = {}
    for j in range(rng.randint(3, 6)):
        key = f"{rng.choice(text.words)}_{j}"
        if j == 1 and rng.random() < 0.5:
            props[key] = {"type": "object", "description": text.text(rng.randint(3, 8)), "properties": {
                f"{rng.choice(text.words)}_{i}": {"type": rng.choice(("string", "integer", "number")),
                                                   "description": text.text(rng.randint(2, 6))}
                for i in range(rng.randint(2, 3))}}
        elif rng.random() < 0.2:
            props[key] = {"type": "string", "enum": [rng.choice(text.words) for _ in range(rng.randint(2, 4))]}
        else:
            props[key] = {"type": rng.choice(("string", "integer", "number", "boolean")),
                          "description": text.text(rng.randint(3, 10))}
    return {"type": "function", "function": {
        "name": name, "description": text.text(rng.randint(10, 30)),
        "parameters": {"type": "object", "properties": props, "required": [next(iter(props))]}}}


def _tool_set(k: int, tokens: int, system: str, text: _Text, count: _Counter) -> list[dict]:
    """Tools until the set's schemas render to about ``tokens`` tokens."""
    bare = count([{"role": "system", "content": system}])
    tools: list[dict] = []
    while count([{"role": "system", "content": system}], tools) - bare < tokens:
        tools.append(_tool(text, f"set{k}_tool{len(tools)}"))
    return tools


def build_agent_workload(n: int, model_dir: Path, seed: int = 0,
                         max_prompt: int = AGENT_MAX_PROMPT) -> list[ChatRequest]:
    """``n`` tool-using requests in order (see the module docstring); ``model_dir``'s
    template must print the tools (``kvevents.demo.chat_templates.TOOLS``)."""
    rng = random.Random(seed)
    text = _Text(rng)
    count = _Counter(model_dir)
    systems = [f"You are agent {k}. Use the tools to finish the user's task. " + text.text(rng.randint(60, 120))
               for k in range(len(TOOL_SET_TOKENS))]
    sets = [_tool_set(k, tokens, systems[k], text, count) for k, tokens in enumerate(TOOL_SET_TOKENS)]

    def new_session(k: int) -> dict:
        t = rng.choices(range(len(sets)), TOOL_SET_WEIGHTS)[0]
        return {"name": f"agent-{k}", "set": t, "turns": rng.randint(2, 6), "done": 0,
                "messages": [{"role": "system", "content": systems[t]},
                             {"role": "user", "content": "Task: " + text.text(rng.randint(60, 160))}]}

    def turn(s: dict, index: int) -> ChatRequest | None:
        tools = sets[s["set"]]
        if s["done"]:  # what the model did with the previous turn, written by the generator
            if rng.random() < 0.75:  # a tool call and its result
                call_id = f"call_{s['name']}_{s['done']}"
                fn = rng.choice(tools)["function"]
                args = {key: text.text(rng.randint(2, 8)) for key in list(fn["parameters"]["properties"])[:2]}
                s["messages"] += [
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": call_id, "type": "function",
                         "function": {"name": fn["name"], "arguments": json.dumps(args)}}]},
                    {"role": "tool", "tool_call_id": call_id, "content": text.text(rng.randint(60, 250))}]
            else:  # an answer, then the user's follow-up
                s["messages"] += [{"role": "assistant", "content": text.text(rng.randint(30, 60))},
                                  {"role": "user", "content": text.text(rng.randint(30, 80))}]
        messages = [dict(m) for m in s["messages"]]
        tokens = count(messages, tools)
        if tokens > max_prompt:
            return None
        return ChatRequest(index, s["name"], "agent", messages, rng.randint(8, 16), tokens, tools)

    return _interleave(n, rng, new_session, turn)


def _block_keys(root: bytes, ids: list[int], block: int) -> list[bytes]:
    """The chained keys of the whole blocks of ``ids`` (a block's key covers its parents)."""
    import hashlib

    keys, key = [], root
    for b in range(len(ids) // block):
        key = hashlib.blake2b(key + repr(ids[b * block:(b + 1) * block]).encode(), digest_size=16).digest()
        keys.append(key)
    return keys


def _run(keys: list[bytes], seen: set[bytes], n_ids: int, block: int) -> int:
    """Leading blocks of ``keys`` in ``seen``, less a fully cached prompt's last one
    (vLLM computes it again)."""
    n = 0
    while n < len(keys) and keys[n] in seen:
        n += 1
    return n - 1 if n and n * block == n_ids else n


def endless_cache_hits(reqs: list[ChatRequest], model_dir: Path, block: int = 32) -> int:
    """The hit tokens of one engine whose cache never evicts, serving ``reqs`` in order:
    every whole block of a request's prefix that an earlier request of the same cache
    identity (adapter, salt) already computed (vLLM computes a fully cached prompt's
    last block again). No router on any fleet gets more."""
    count = _Counter(model_dir)
    seen: set[bytes] = set()
    hits = 0
    for r in reqs:
        ids = count.ids(r.messages, r.tools)
        keys = _block_keys(repr((r.model, r.cache_salt)).encode(), ids, block)
        hits += _run(keys, seen, len(ids), block) * block
        seen.update(keys)
    return hits


def identity_collisions(reqs: list[ChatRequest], served: list[tuple[int, str]], model_dir: Path,
                        block: int = 32) -> dict:
    """What a router whose tree holds text alone counts as cached that vLLM does not reuse.

    ``served``: (request index, engine it ran on), in the order the requests were sent.
    Per request, on its engine: the leading whole blocks that an earlier request sent
    there holds as *text* (any adapter, any salt), less those held under the request's
    own identity. vLLM reuses none of that difference: another adapter's or tenant's
    blocks. Counted before any eviction (each engine's history whole), so it is the
    collisions a text tree sees, not its eviction misses. Returns the tokens, and the
    requests with any."""
    count = _Counter(model_dir)
    text: dict[str, set[bytes]] = {}
    own: dict[str, set[bytes]] = {}
    tokens = requests = 0
    for i, engine in served:
        r = reqs[i]
        ids = count.ids(r.messages, r.tools)
        tkeys = _block_keys(b"", ids, block)
        okeys = _block_keys(repr((r.model, r.cache_salt)).encode(), ids, block)
        t, o = text.setdefault(engine, set()), own.setdefault(engine, set())
        extra = _run(tkeys, t, len(ids), block) - _run(okeys, o, len(ids), block)
        if extra > 0:
            tokens += extra * block
            requests += 1
        t.update(tkeys)
        o.update(okeys)
    return {"tokens": tokens, "requests": requests, "located": len(served)}


def build_tenant_workload(n: int, model_dir: Path, seed: int = 0, adapters: tuple[str, ...] = ("sql", "chat", "code"),
                          tenants: int = 4) -> list[ChatRequest]:
    """:func:`build_workload`'s requests, each session under one identity drawn evenly
    from ``adapters`` and ``tenants`` salted tenants of the base model (see the module
    docstring)."""
    import dataclasses

    rng = random.Random(seed + 1)
    identities = [(name, None) for name in adapters] + [(None, f"tenant-{k}") for k in range(tenants)]
    of: dict[str, tuple[str | None, str | None]] = {}
    out = []
    for r in build_workload(n, model_dir, seed):
        model, salt = of.setdefault(r.session, rng.choice(identities))
        out.append(dataclasses.replace(r, model=model, cache_salt=salt))
    return out

