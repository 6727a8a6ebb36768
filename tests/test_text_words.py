"""The word cache for new ASCII text (``kvevents/text/words.py``): ids equal
``transformers``' for GPT-2 style and Llama 3 style byte-level BPE tokenizers, the path
is really taken, and everything it cannot prove exact goes to the library."""

from __future__ import annotations

import random

import msgspec
import pytest

from text_tokenizer import CORPUS, LLAMA3_SPLIT, build_bytelevel, require_transformers
from kvevents.text import TextTokenizer, _split
from kvevents.text.chat import ChatMessage
from kvevents.text.words import (GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, WordEncoder,
                                 ascii_pattern)

# Qwen 2's split (its tokenizer.json's): Llama 3's with one digit per word. Written out
# here, not taken from the product, so a slip in either shows.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

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


SPLITS = {"gpt2-bytelevel": None, "llama3-split": LLAMA3_SPLIT, "qwen2-split": QWEN2_SPLIT}


@pytest.fixture(scope="module", params=list(SPLITS))
def pair(request, tmp_path_factory):
    require_transformers()
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp(request.param)
    path = build_bytelevel(directory, split=SPLITS[request.param])
    return TextTokenizer("m", path), AutoTokenizer.from_pretrained(path)


def test_the_common_patterns_take_the_compiled_split(pair):
    ours, _ = pair
    assert ours._pieces._words._kind in (_split.GPT2, _split.LLAMA3, _split.QWEN2)


@pytest.mark.parametrize("pattern, kind", [(GPT2_PATTERN, _split.GPT2),
                                           (LLAMA3_PATTERN, _split.LLAMA3),
                                           (QWEN2_PATTERN, _split.QWEN2)])
def test_the_compiled_split_cuts_ascii_as_python_re_does(pattern, kind):
    python = ascii_pattern(pattern)
    rng = random.Random(kind)
    dense = list(" \t\n\r\x0b\x0c'sStTrReEvVmMlLdD0912aZ.,!-_") + ["  ", "\r\n", "'ll", "'RE"]
    everything = [chr(c) for c in range(128)]
    for n in range(20_000):
        alphabet = dense if n % 2 else everything
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        assert _split.split(text, kind) == python.findall(text), repr(text)
    with pytest.raises(ValueError):
        _split.split("café", kind)


def test_join_cached_reports_new_words_once_and_takes_what_learn_returns():
    cache = {"a": b"\x01" + bytes(7), " b": b"\x02" + bytes(7)}
    assert _split.join_cached("a b", cache, _split.GPT2) == b"\x01" + bytes(7) + b"\x02" + bytes(7)
    assert _split.join_cached("a b c b c d", cache, _split.GPT2) == [" c", " d"]  # no learn
    learned = []

    def learn(words):
        learned.append(words)
        return [bytes([len(w) + 1]) + bytes(7) for w in words]

    got = _split.join_cached("a b c b c d", cache, _split.GPT2, learn)
    assert learned == [[" c", " d"]]
    assert got == b"".join(bytes([x]) + bytes(7) for x in (1, 2, 3, 2, 3, 3))
    assert _split.join_cached("a zz", cache, _split.GPT2, lambda words: None) is None
    assert _split.join_cached("né", cache, _split.GPT2, learn) is None  # not ASCII
    with pytest.raises(TypeError):
        _split.join_cached("a", {"a": "not bytes"}, _split.GPT2)


def test_new_words_are_encoded_the_same_every_way(pair):
    """One by one by the model (a few), joined in one call (more), in a batch (no added
    token to join by): each word's ids as the library encodes it alone."""
    ours, _ = pair
    tok = ours._tok
    words = ours._pieces._words
    rng = random.Random(6)
    new = sorted({w for text in _texts(30, seed=7) for w in words._findall(text)})
    rng.shuffle(new)
    want = [tok.encode(w, add_special_tokens=False).ids for w in new]
    batch_only = WordEncoder(words._pattern, words._encode_many, {})
    for n in (1, 5, 16, 17, len(new)):
        for encoder in (words, batch_only):
            got = [list(memoryview(b).cast("q")) for b in encoder._encode_words(new[:n])]
            assert got == want[:n], (n, encoder is words)


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
