"""What tokenizing a request costs, proven on a real tokenizer: what a conversation
shares is encoded once (only the new turn is encoded), the ids still equal
``transformers``' for the whole prompt, and a long prompt encoded on a worker thread
leaves the event loop running (the Rust encoder releases the GIL)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from text_tokenizer import CORPUS, build_bytelevel, require_transformers
from kvevents.text import TextTokenizer
from kvevents.text.chat import ChatMessage


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    require_transformers()
    from transformers import AutoTokenizer

    path = build_bytelevel(tmp_path_factory.mktemp("tok"))
    return TextTokenizer("m", path), AutoTokenizer.from_pretrained(path)


def _reference(auto, messages: list[dict]) -> list[int]:
    out = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_shared_system_prompts_are_encoded_once_and_only_the_new_turn_after(pair):
    """The gateway's common request: one of a few system prompts, a new user turn."""
    ours, auto = pair
    systems = [f"System prompt {k}: " + CORPUS * (k + 1) for k in range(3)]
    for i in range(12):
        messages = [{"role": "system", "content": systems[i % 3]},
                    {"role": "user", "content": f"question {i}: where is the prefix {i * 7}?"}]
        before = ours.cache_stats()
        got = ours.chat_ids([ChatMessage(**m) for m in messages])
        after = ours.cache_stats()
        assert got.tolist() == _reference(auto, messages), i
        # Pieces: <s>, <|im_start|>, system turn, "\n<|im_start|>", user turn,
        # "\n<|im_start|>", "assistant\n". New each time: the user turn alone, once
        # every system prompt and the markers have been seen.
        new = after["misses"] - before["misses"]
        assert new == 1 if i >= 3 else new >= 1, (i, new)


def test_a_growing_conversation_encodes_only_its_new_turns(pair):
    ours, auto = pair
    messages: list[dict] = [{"role": "system", "content": "You are terse. " + CORPUS}]
    for turn in range(6):
        messages.append({"role": "user", "content": f"turn {turn}: and then? {CORPUS[:80 + turn]}"})
        before = ours.cache_stats()
        got = ours.chat_ids([ChatMessage(**m) for m in messages])
        after = ours.cache_stats()
        assert got.tolist() == _reference(auto, messages), turn
        if turn:  # the previous assistant turn and this user turn, nothing else
            assert after["misses"] - before["misses"] <= 2, turn
        messages.append({"role": "assistant", "content": f"answer {turn}: " + CORPUS[turn * 9:]})


def _max_loop_gap(encode, text: str) -> tuple[float, float]:
    """(longest gap between ticks of an event loop, encode's duration) while ``encode``
    runs on a worker thread, as the server runs long prompts."""
    async def run() -> tuple[float, float]:
        loop = asyncio.get_running_loop()
        done = threading.Event()
        gaps = [0.0]

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps[0] = max(gaps[0], now - last)
                last = now

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        t0 = time.perf_counter()
        await loop.run_in_executor(None, encode, text)
        took = time.perf_counter() - t0
        done.set()
        await tick
        return gaps[0], took
    return asyncio.run(run())


def test_a_long_prompt_encoded_on_a_thread_leaves_the_loop_running(pair, monkeypatch):
    ours, _ = pair
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")  # as kvevents serve runs
    text = " ".join(f"{CORPUS} {i}" for i in range(1500))  # ~600 KB, never seen
    # The control: the library's encode holds the GIL for the whole encode.
    held, took = _max_loop_gap(lambda t: ours._tok.encode(t, add_special_tokens=False), text)
    assert took > 0.05 and held > 0.8 * took, (held, took)
    gap, took = _max_loop_gap(ours.prompt_ids, text + " new")
    assert gap < 0.3 * took, (gap, took)
