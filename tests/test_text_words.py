"""The word cache for new ASCII text (``kvevents/text/words.py``): ids equal
``transformers``' for GPT-2 style and Llama 3 style byte-level BPE tokenizers, the path
is really taken, and everything it cannot prove exact goes to the library."""

from __future__ import annotations

import random

import msgspec
import pytest

from text_tokenizer import CORPUS, LLAMA3_SPLIT, build_bytelevel, require_transformers
from kvevents.text import TextTokenizer
from kvevents.text.chat import ChatMessage
from kvevents.text.words import WordEncoder, ascii_pattern

ASCII_CORPUS = "".join(c for c in CORPUS if c.isascii())


def _texts(n: int, seed: int) -> list[str]:
    """ASCII texts of every kind the split cares about: words, contractions in any case,
    digit runs, punctuation and whitespace runs, control characters."""
    rng = random.Random(seed)
    words = ASCII_CORPUS.split() + ["It's", "WE'LL", "they'Re", "'s", "1234567", "3.14",
                                    "--->", "\r\n", "\t\t", "  ", "\x0b", "\x1f", "a_b", "x'"]
    out = []
    for _ in range(n):
        seps = [" ", "", "  ", "\n", "\r\n", "\t", " \n "]
        out.append("".join(rng.choice(words) + rng.choice(seps) for _ in range(rng.randrange(1, 40))))
    out += ["".join(chr(rng.randrange(128)) for _ in range(rng.randrange(1, 80))) for _ in range(n)]
    return out


@pytest.fixture(scope="module", params=["gpt2-bytelevel", "llama3-split"])
def pair(request, tmp_path_factory):
    require_transformers()
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp(request.param)
    path = build_bytelevel(directory, split=None if request.param == "gpt2-bytelevel" else LLAMA3_SPLIT)
    return TextTokenizer("m", path), AutoTokenizer.from_pretrained(path)


def test_ascii_prompts_come_from_the_word_cache_and_equal_transformers(pair):
    ours, auto = pair
    assert ours._pieces._words is not None  # this shape takes the word path
    texts = _texts(150, seed=1)
    for round_ in range(2):  # words new, then known
        for text in texts:
            assert ours.prompt_ids(text + f" {round_}").tolist() == auto(text + f" {round_}")["input_ids"], repr(text)
    stats = ours.cache_stats()
    assert stats["word_pieces"] >= len(texts), stats  # the word path encoded them
    assert stats["words"] > 100, stats


def test_chats_with_new_ascii_turns_equal_transformers(pair):
    ours, auto = pair
    rng = random.Random(2)
    texts = _texts(40, seed=3)
    for i in range(40):
        messages = [{"role": "system", "content": "You are terse. " + ASCII_CORPUS},
                    {"role": "user", "content": texts[i]},
                    {"role": "assistant", "content": rng.choice(texts)},
                    {"role": "user", "content": f"and {i}? <|im_end|> inside" if i % 5 == 0 else texts[-i]}]
        before = ours.cache_stats()["word_pieces"]
        got = ours.chat_ids(msgspec.convert(messages, list[ChatMessage])).tolist()
        out = auto.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert got == list(out["input_ids"] if hasattr(out, "keys") else out), i
        assert ours.cache_stats()["word_pieces"] > before


def test_non_ascii_and_added_tokens_inside_go_to_the_library_and_stay_equal(pair):
    ours, auto = pair
    words = ours._pieces._words
    for text in ["café au lait " * 3, "東京 and ascii", "🙂"]:
        before = words.pieces
        assert ours.prompt_ids(text).tolist() == auto(text)["input_ids"], text
        assert words.pieces == before, text  # not encoded from the cache
    for text in ["x <|im_start|> y", "a</s>b <s>"]:  # cut after split tokens: cache
        assert ours.prompt_ids(text).tolist() == auto(text)["input_ids"], text
    # A split token that ends a piece is cut off and appended; one inside is not taken.
    end = auto("tail<|im_end|>", add_special_tokens=False)["input_ids"]
    assert words.encode("tail<|im_end|>").tolist() == end
    assert words.encode("a<|im_end|>b") is None  # a token inside a piece: library
    assert words.encode("a<|im_end|></s>") is None  # two: library
    assert words.encode("x" * 20_000) is None  # long: the library, which releases the GIL


def test_a_bounded_cache_starts_again_and_stays_exact(pair):
    ours, auto = pair
    words = ours._pieces._words
    small = WordEncoder(words._pattern, words._encode_many, {}, max_words=50)
    taken = 0
    for text in _texts(60, seed=4):
        got = small.encode(text)
        if got is not None:
            taken += 1
            assert got.tolist() == auto(text, add_special_tokens=False)["input_ids"], repr(text)
        assert small.words <= 50
    assert taken >= 50


def test_a_normalizer_rules_the_word_path_out(tmp_path):
    require_transformers()
    from transformers import AutoTokenizer

    path = build_bytelevel(tmp_path / "nfc", split=LLAMA3_SPLIT, nfc=True)
    ours, auto = TextTokenizer("m", path), AutoTokenizer.from_pretrained(path)
    assert ours._pieces._words is None
    for text in _texts(10, seed=5):
        assert ours.prompt_ids(text).tolist() == auto(text)["input_ids"]


def test_a_split_that_differs_from_the_library_fails_the_self_check(pair):
    ours, _ = pair
    tok = ours._tok
    wrong = WordEncoder(ascii_pattern(r"\S+|\s+"), ours._pieces._words._encode_many, {})
    assert not wrong.self_check(lambda t: tok.encode(t, add_special_tokens=False).ids, [])
    right = WordEncoder(ours._pieces._words._pattern, ours._pieces._words._encode_many, {})
    assert right.self_check(lambda t: tok.encode(t, add_special_tokens=False).ids, [])


@pytest.mark.parametrize("source, expected", [
    (r" ?\p{L}+| ?\p{N}+", r" ?[A-Za-z]+| ?[0-9]+"),
    (r"[^\s\p{L}\p{N}]+", r"[^\sA-Za-z0-9]+"),
    (r"[^\r\n\p{L}\p{N}]?\p{L}+", r"[^\r\nA-Za-z0-9]?[A-Za-z]+"),
    (r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+", r"[A-Z]*[a-z]+"),
    (r"\pL+", r"[A-Za-z]+"),
])
def test_unicode_classes_become_their_ascii_members(source, expected):
    assert ascii_pattern(source).pattern == expected


@pytest.mark.parametrize("source", [
    r"^\p{L}+", r"\p{L}+$", r"\P{L}+", r"\p{Sc}", r"\p{Lo}+", r"[[:alpha:]]+", r"\h+", r"(a)\1",
    r"[\p{L}",
])
def test_syntax_it_cannot_translate_is_refused(source):
    assert ascii_pattern(source) is None
