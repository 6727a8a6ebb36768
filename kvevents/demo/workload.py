"""Demo workloads: a built-in generator of realistic sharing, and Mooncake traces.

Both produce :class:`DemoRequest` lists sorted by arrival (simulated seconds). No torch,
no engine imports: the same requests feed the demo and the routing benchmark (P7).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

VOCAB = 32_000
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace format


@dataclass(frozen=True)
class DemoRequest:
    id: str
    arrival: float  # simulated seconds from the start
    token_ids: list[int]
    max_new_tokens: int


def builtin(n_requests: int = 240, rate: float = 4.0, seed: int = 0) -> list[DemoRequest]:
    """Shared system prompts, multi-turn conversations and questions over long documents.

    - 4 system prompts of 1,024 tokens, one per "application";
    - conversations that start on a system prompt and grow turn by turn (the previous
      prompt, a simulated answer, a new user message): each turn's prompt extends the
      last one, the cache-friendliest pattern in chat serving;
    - 6 documents of 4-8k tokens that several users ask questions about.
    Arrivals are Poisson at ``rate`` requests per simulated second.
    """
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, 1024) for _ in range(4)]
    docs = [rng.integers(0, VOCAB, int(rng.integers(4096, 8192))) for _ in range(6)]
    conversations: list[np.ndarray] = []
    out: list[DemoRequest] = []
    t = 0.0
    for i in range(n_requests):
        t += float(rng.exponential(1.0 / rate))
        kind = rng.random()
        if kind < 0.45 and conversations:
            c = int(rng.integers(len(conversations)))
            answer = rng.integers(0, VOCAB, int(rng.integers(64, 256)))
            user = rng.integers(0, VOCAB, int(rng.integers(64, 512)))
            prompt = np.concatenate([conversations[c], answer, user])
            if prompt.size > 14_000:  # a conversation that got too long starts over
                prompt = np.concatenate([systems[c % 4], user])
            conversations[c] = prompt
        elif kind < 0.7:
            user = rng.integers(0, VOCAB, int(rng.integers(128, 512)))
            prompt = np.concatenate([systems[int(rng.integers(4))], user])
            conversations.append(prompt)
        else:
            question = rng.integers(0, VOCAB, int(rng.integers(32, 256)))
            d = min(int(rng.zipf(1.5)) - 1, len(docs) - 1)
            prompt = np.concatenate([systems[d % 4], docs[d], question])
        out.append(DemoRequest(f"req-{i}", t, prompt.tolist(), int(rng.integers(8, 32))))
    return out


def _block_tokens(hash_id: int) -> np.ndarray:
    """The 512 token ids an anonymised trace block stands for (deterministic)."""
    return np.random.default_rng(hash_id).integers(0, VOCAB, TRACE_BLOCK)


def mooncake_trace(path: str | Path, max_requests: int | None = None,
                   max_new_tokens: int = 32) -> list[DemoRequest]:
    """Requests of a Mooncake-format trace (``timestamp`` ms, ``input_length``,
    ``output_length``, ``hash_ids`` of 512-token blocks). Each id expands to the same
    512 tokens wherever it appears, so shared leading ids are shared prefixes; the last
    block is cut to ``input_length``. Output lengths are capped at ``max_new_tokens``
    (decode cost is charged by the engines' time model; generating 343 tokens each
    would only slow the replay). Raises ``ValueError`` naming the bad line."""
    out: list[DemoRequest] = []
    cache: dict[int, np.ndarray] = {}
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if max_requests is not None and len(out) >= max_requests:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = [int(h) for h in rec["hash_ids"]]
                n = int(rec["input_length"])
                ts = float(rec["timestamp"]) / 1000.0
                out_len = int(rec.get("output_length", 1))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record ({exc})") from None
            if n <= 0 or not ids:
                continue
            blocks = []
            for h in ids:
                b = cache.get(h)
                if b is None:
                    b = cache[h] = _block_tokens(h)
                blocks.append(b)
            toks = np.concatenate(blocks)[:n]
            out.append(DemoRequest(f"trace-{lineno}", ts, toks.tolist(),
                                   max(1, min(out_len, max_new_tokens))))
    out.sort(key=lambda r: r.arrival)
    return out


def compact(n_requests: int = 40, rate: float = 4.0, seed: int = 0, vocab: int = 1024,
            max_len: int = 512) -> list[DemoRequest]:
    """The built-in workload's patterns, scaled to a tiny real model (``--engine vllm``).

    Token ids below ``vocab``; every prompt plus its new tokens fits ``max_len``. Shared
    system prompts (96 tokens), conversations growing turn by turn (restarting when they
    would not fit) and questions over documents (160-288 tokens).
    """
    rng = np.random.default_rng(seed)
    systems = [rng.integers(1, vocab, 96) for _ in range(3)]
    docs = [rng.integers(1, vocab, int(rng.integers(160, 288))) for _ in range(4)]
    conversations: list[np.ndarray] = []
    out: list[DemoRequest] = []
    t = 0.0
    for i in range(n_requests):
        t += float(rng.exponential(1.0 / rate))
        new = int(rng.integers(4, 12))
        kind = rng.random()
        if kind < 0.45 and conversations:
            c = int(rng.integers(len(conversations)))
            user = rng.integers(1, vocab, int(rng.integers(16, 64)))
            prompt = np.concatenate([conversations[c], rng.integers(1, vocab, 24), user])
            if prompt.size + new > max_len:
                prompt = np.concatenate([systems[c % 3], user])
            conversations[c] = prompt
        elif kind < 0.7:
            prompt = np.concatenate([systems[int(rng.integers(3))], rng.integers(1, vocab, int(rng.integers(16, 96)))])
            conversations.append(prompt)
        else:
            d = min(int(rng.zipf(1.5)) - 1, len(docs) - 1)
            prompt = np.concatenate([systems[d % 3], docs[d], rng.integers(1, vocab, int(rng.integers(8, 48)))])
        out.append(DemoRequest(f"req-{i}", t, prompt[: max_len - new].tolist(), new))
    return out
