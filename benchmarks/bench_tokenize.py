"""P9: tokenization cost of lookups by prompt text and chat, what the cache saves, and
whether a long prompt encoded on a worker thread leaves the event loop running.

A byte-level BPE tokenizer (vocabulary 16k) is trained here with ``tokenizers`` on the
repository's own documentation, saved as a Hugging Face tokenizer directory with a
ChatML chat template, and loaded by :class:`kvevents.text.TextTokenizer` as
``serve --tokenizer`` does. Measured, per call, single thread:

* ``prompt 2k, new``: a 2,048-token prompt never seen before (cache miss), against
  the ``tokenizers`` library's own ``encode`` of the same text (the floor);
* ``prompt 2k, repeated``: the same prompt again (a whole-text cache hit);
* ``chat turn N``: a conversation growing turn by turn (system prompt, then user /
  assistant turns of ~60-250 tokens, up to ~4k tokens); each turn's lookup sends the
  whole conversation. ``cached`` is what the server does (earlier turns come from the
  piece cache), ``uncached`` renders and encodes the whole text every time;
* ``new user turn``: the gateway's common request, one of 8 system prompts (cached
  after its first use) and a new ~280-token user turn: ``encode_chat`` whole, and the
  ``tokenizers`` library's ``encode`` of the new turn alone (what encoding it cost before
  ``encode_batch_fast``);
* ``loop stall``: a thread that wakes every 0.5 ms (an event loop) while another thread
  encodes a 180 KB prompt: its longest wait, with the library's ``encode`` (holds the
  GIL throughout) and with ``TextTokenizer.encode_prompt`` (releases it).

Times are the calling thread's CPU time (``time.thread_time``), not wall time, so a
busy shared machine does not inflate them; the library's own thread pool is off
(``TOKENIZERS_PARALLELISM=false``, as ``kvevents serve`` runs it), so all the work is
on the calling thread. The stall is wall time, by its nature.

    .venv/bin/python benchmarks/bench_tokenize.py [--conversations 30] [--turns 24]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import machine, median, percentile, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ["TOKENIZERS_PARALLELISM"] = "false"  # as kvevents serve runs (see the docstring)

from kvevents.text import TextTokenizer  # noqa: E402
from kvevents.text.chat import ChatMessage  # noqa: E402

CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
          "{{ message['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def corpus() -> list[str]:
    files = [ROOT / "README.md", *sorted((ROOT / "benchmarks").glob("*.md")),
             *sorted(ROOT.glob("kvevents/**/*.py")), *sorted(ROOT.glob("connector/**/*.py"))]
    return [f.read_text(encoding="utf-8") for f in files if f.is_file()]


def build_tokenizer(directory: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=16_000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": CHATML}))


def timed(fn, *args) -> tuple[float, object]:
    """CPU seconds of this thread spent in ``fn(*args)``, and its result."""
    t0 = time.thread_time()
    out = fn(*args)
    return time.thread_time() - t0, out


def loop_stall(fn, *args) -> float:
    """Longest wait (s) of a thread waking every 0.5 ms while ``fn(*args)`` runs here."""
    stop, gaps = threading.Event(), [0.0]

    def ticker() -> None:
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.0005)
            now = time.perf_counter()
            gaps[0] = max(gaps[0], now - last)
            last = now
    th = threading.Thread(target=ticker)
    th.start()
    time.sleep(0.02)
    try:
        fn(*args)
    finally:
        stop.set()
        th.join()
    return gaps[0]


def words(rng: random.Random, pool: list[str], n: int) -> str:
    return " ".join(rng.choice(pool) for _ in range(n))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conversations", type=int, default=30)
    ap.add_argument("--turns", type=int, default=24)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--out", default="benchmarks/results/tokenize.json")
    args = ap.parse_args()
    texts = corpus()
    pool = " ".join(texts).split()
    rng = random.Random(7)
    with tempfile.TemporaryDirectory() as tmp:
        build_tokenizer(Path(tmp) / "tok", texts)
        tok = TextTokenizer("bench", Path(tmp) / "tok")
        raw = tok._tok  # the tokenizers.Tokenizer inside: the floor to compare with

        # 2k-token prompts: grow random text until it encodes to 2,048 tokens.
        prompts = []
        for _ in range(args.prompts):
            text = words(rng, pool, 1400)
            ids = raw.encode(text, add_special_tokens=False).ids
            while len(ids) < 2048:
                text += " " + words(rng, pool, 200)
                ids = raw.encode(text, add_special_tokens=False).ids
            prompts.append(raw.decode(ids[:2048]))
        floor, new, again = [], [], []
        for p in prompts:
            floor.append(timed(raw.encode, p)[0])
            dt, ids = timed(tok.encode_prompt, p)
            new.append(dt)
            again.append(timed(tok.encode_prompt, p)[0])
        n_tokens = median([len(tok.encode_prompt(p)) for p in prompts[:20]])

        # Growing conversations.
        cached: dict[int, list[float]] = {}
        uncached: dict[int, list[float]] = {}
        render: dict[int, list[float]] = {}
        lengths: dict[int, list[int]] = {}
        for _ in range(args.conversations):
            msgs = [ChatMessage(role="system", content=words(rng, pool, 250))]
            for turn in range(1, args.turns + 1):
                role = "user" if turn % 2 else "assistant"
                msgs.append(ChatMessage(role=role, content=words(rng, pool, rng.randint(40, 180))))
                if role != "user":
                    continue  # lookups happen when a user turn arrives
                dt_render, text = timed(tok.render_chat, msgs)
                dt_full, full = timed(lambda t: raw.encode(t, add_special_tokens=False).ids, text)
                dt_cached, ids = timed(tok.encode_chat, msgs)
                assert ids == full, "cached ids differ from a whole encode"
                render.setdefault(turn, []).append(dt_render)
                uncached.setdefault(turn, []).append(dt_render + dt_full)
                cached.setdefault(turn, []).append(dt_cached)
                lengths.setdefault(turn, []).append(len(ids))

        # The gateway's common request: a cached system prompt, a new user turn.
        systems = [words(rng, pool, 250) for _ in range(8)]
        turn_new, turn_floor, turn_fast, turn_tokens = [], [], [], []
        for i in range(args.prompts):
            msgs = [ChatMessage(role="system", content=systems[i % 8]),
                    ChatMessage(role="user", content=f"request {i}: " + words(rng, pool, 110))]
            if i < 8:
                tok.encode_chat(msgs)  # the system prompt's first use: not measured
                continue
            user_piece = tok._pieces.pieces(tok.render_chat(msgs))[-3]
            turn_floor.append(timed(lambda t: raw.encode(t, add_special_tokens=False).ids, user_piece)[0])
            turn_fast.append(timed(lambda t: raw.encode_batch_fast([t], add_special_tokens=False)[0].ids,
                                   user_piece)[0])
            dt, ids = timed(tok.encode_chat, msgs)
            turn_new.append(dt)
            turn_tokens.append(len(raw.encode(user_piece, add_special_tokens=False).ids))

        # A long prompt encoded on this thread while a ticker thread stands for the loop.
        long_text = " ".join(texts)[:180_000]
        stall_encode = median([loop_stall(raw.encode, long_text) for _ in range(3)])
        stall_ours = median([loop_stall(tok.encode_prompt, long_text + f" {i}") for i in range(3)])

    us = 1e6
    rows = [["prompt 2k, new (tokenizers encode: floor)", n_tokens, f"{median(floor)*us:,.0f}", f"{percentile(floor, 99)*us:,.0f}"],
            ["prompt 2k, new (kvevents)", n_tokens, f"{median(new)*us:,.0f}", f"{percentile(new, 99)*us:,.0f}"],
            ["prompt 2k, repeated (cache hit)", n_tokens, f"{median(again)*us:,.0f}", f"{percentile(again, 99)*us:,.0f}"]]
    chat_rows = []
    for turn in sorted(cached):
        chat_rows.append([turn, int(median(lengths[turn])), f"{median(render[turn])*us:,.0f}",
                          f"{median(uncached[turn])*us:,.0f}", f"{median(cached[turn])*us:,.0f}",
                          f"{median(uncached[turn]) / median(cached[turn]):.1f}x"])
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print("2k-token prompts (us per call)")
    print_table(["case", "tokens", "p50 us", "p99 us"], rows)
    print("\ngrowing conversations (us per lookup, median over conversations)")
    print_table(["turn", "tokens", "render", "uncached", "cached", "saved"], chat_rows)
    print(f"\nnew user turn after a cached system prompt ({int(median(turn_tokens))} new tokens; "
          "us CPU per call)")
    print_table(["case", "p50 us", "p99 us"], [
        ["tokenizers encode of the new turn alone", f"{median(turn_floor)*us:,.0f}",
         f"{percentile(turn_floor, 99)*us:,.0f}"],
        ["tokenizers encode_batch_fast of the new turn alone", f"{median(turn_fast)*us:,.0f}",
         f"{percentile(turn_fast, 99)*us:,.0f}"],
        ["kvevents encode_chat (render, cache, encode new)", f"{median(turn_new)*us:,.0f}",
         f"{percentile(turn_new, 99)*us:,.0f}"]])
    print(f"\nloop stall while a {len(long_text):,}-character prompt encodes on another thread "
          f"(ms, median of 3): tokenizers encode {stall_encode*1e3:.1f}, "
          f"kvevents encode_prompt {stall_ours*1e3:.1f}")
    write_json(args.out, {
        "machine": machine(), "load_average": os.getloadavg(), "command": " ".join(sys.argv),
        "prompt_2k_us": {"tokens": n_tokens,
                         "floor_p50": median(floor) * us, "floor_p99": percentile(floor, 99) * us,
                         "new_p50": median(new) * us, "new_p99": percentile(new, 99) * us,
                         "repeated_p50": median(again) * us, "repeated_p99": percentile(again, 99) * us},
        "conversation_us": [{"turn": t, "tokens": median(lengths[t]), "render_p50": median(render[t]) * us,
                             "uncached_p50": median(uncached[t]) * us, "cached_p50": median(cached[t]) * us}
                            for t in sorted(cached)],
        "new_user_turn_us": {"new_tokens": median(turn_tokens),
                             "tokenizers_encode_p50": median(turn_floor) * us,
                             "tokenizers_encode_batch_fast_p50": median(turn_fast) * us,
                             "encode_chat_p50": median(turn_new) * us,
                             "encode_chat_p99": percentile(turn_new, 99) * us},
        "loop_stall_ms": {"chars": len(long_text), "tokenizers_encode": stall_encode * 1e3,
                          "encode_prompt": stall_ours * 1e3},
        "piece_cache": tok.cache_stats(),
    })


if __name__ == "__main__":
    main()
