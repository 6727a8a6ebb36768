"""Encode ASCII text word by word from a cache, for regex-split byte-level BPE tokenizers.

Why this is exact: such a tokenizer (GPT-2, Llama 3, Qwen 2/3...) cuts its input at
added tokens, splits each stretch between them into words with one regex, and has the
BPE model encode every word on its own. So a text's ids are the concatenation of its
words' ids, and a word's ids never change: they can be cached. Only tokenizers whose
``tokenizer.json`` has exactly that shape get this path: no normalizer, a BPE model
without dropout, and either ``ByteLevel(use_regex=true, add_prefix_space=false)`` (the
GPT-2 regex) or ``Sequence[Split(Regex, "Isolated"), ByteLevel(use_regex=false,
add_prefix_space=false)]``. A word is encoded the first time it is seen by the
tokenizer itself, so only the split must match the library's.

The split runs on ASCII pieces up to 16 KiB, where the Unicode classes the patterns use
reduce to plain ranges (``\\p{L}`` to ``A-Za-z``, ``\\p{N}`` to ``0-9``) and ``\\s`` means the
same in both engines: for the GPT-2, Llama 3 and Qwen 2 patterns in compiled code
(:mod:`kvevents.text._split`, which also looks the words up and joins their ids), for
any other in Python's ``re``. Text with any other character, text that holds an
added token's content (other than one split token at the end of a piece, as
:class:`~kvevents.text.segments.SegmentEncoder` cuts them), or a pattern with syntax not
translated here (line anchors, other Unicode classes, nested classes) returns None and
the caller encodes it with the library. :meth:`WordEncoder.self_check` compares both
ways on probe texts at load; any difference disables the path.

Why it pays: the library's regex split costs about 0.3 us per character (150 us for a
500-character user turn); this path costs a fifteenth of that once the words are known
(about 10 us). No Python runs per word or per token: the split, the cache lookups and
the join are one C call over the whole text. New words are encoded by the library: up
to 16 by its BPE model directly (the words' bytes mapped as ``ByteLevel`` maps them;
one word costs about 2 us, against 8-45 us for the whole pipeline), more in one call
joined by an added token, which the library cuts at.

Memory: at most ``max_words`` cached words (their ids as int64 bytes); past that the
cache starts again empty. Thread-safe: a reader holds its own reference to the dict it
read from, and a dict that is replaced is dropped when its last reader finishes.
"""

from __future__ import annotations

import random
import re
from array import array
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np

from kvevents.text._split import GPT2, LLAMA3, QWEN2, join_cached

# tokenizers' ByteLevel pre-tokenizer with use_regex=true splits with this (byte_level.rs).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Llama 3's split (tokenizer.json's Split regex); Qwen 2/3 take one digit per word.
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")

# Unicode classes as their ASCII members ("": none in ASCII).
_ASCII_CLASSES = {"L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "",
                  "N": "0-9", "Nd": "0-9", "Nl": "", "No": "",
                  "M": "", "Mn": "", "Mc": "", "Me": ""}

MAX_WORD_CHARS = 256  # a longer word (a run of spaces, a base64 blob) goes to the library
# A longer piece goes to the library, which releases the GIL while it runs (this path holds
# it): a long prompt encoded on a worker thread must leave the event loop serving.
MAX_PIECE_CHARS = 16 * 1024
_FEW_WORDS = 16  # new words encoded one by one by the model; more: one library call
_ids = attrgetter("ids")
_tobytes = array.tobytes


def ascii_pattern(source: str) -> re.Pattern[str] | None:
    """``source`` (an Oniguruma pattern from tokenizer.json) as a Python pattern that
    splits ASCII text the same way, or None when it uses syntax not translated here."""
    out: list[str] = []
    i, n, in_class = 0, len(source), False
    while i < n:
        c = source[i]
        if c == "\\":
            if i + 1 >= n:
                return None
            e = source[i + 1]
            if e == "p":
                m = re.match(r"\{(\w+)\}|([A-Z])", source[i + 2:])
                if m is None:
                    return None
                members = _ASCII_CLASSES.get(m.group(1) or m.group(2))
                if members is None:
                    return None
                if in_class:
                    out.append(members)
                elif members:
                    out.append(f"[{members}]")
                else:
                    return None
                i += 2 + m.end()
                continue
            if e in "PhHRXKGzZ" or e.isdigit():  # Oniguruma-only or back-references
                return None
            out.append(source[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "[":  # nested class or POSIX bracket
                return None
            if c == "]":
                in_class = False
        elif c == "[":
            in_class = True
            out.append(c)
            i += 1
            if i < n and source[i] == "^":
                out.append("^")
                i += 1
            if i < n and source[i] == "]":  # a literal ] first in a class
                out.append("\\]")
                i += 1
            continue
        elif c in "^$":  # Ruby-syntax line anchors: not Python's
            return None
        out.append(c)
        i += 1
    try:
        return re.compile("".join(out), re.ASCII)
    except re.error:
        return None


def split_pattern(tokenizer_json: dict) -> re.Pattern[str] | None:
    """The ASCII word split of a tokenizer of the shape in the module docstring, else None."""
    model = tokenizer_json.get("model") or {}
    if tokenizer_json.get("normalizer") is not None or model.get("type") != "BPE" \
            or model.get("dropout") not in (None, 0, 0.0):
        return None
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel":
        if pre.get("add_prefix_space") or not pre.get("use_regex", True):
            return None
        return ascii_pattern(GPT2_PATTERN)
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return None
    split, byte_level = steps
    if (split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert")
            or byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space")
            or byte_level.get("use_regex", True)):
        return None
    regex = (split.get("pattern") or {}).get("Regex")
    return ascii_pattern(regex) if isinstance(regex, str) else None


def _ascii_byte_level() -> dict[int, str]:
    """The ``ByteLevel`` pre-tokenizer's character for each ASCII byte (GPT-2's
    ``bytes_to_unicode``): printable ones are themselves, the others (controls, space,
    DEL) take the code points from 256 up, in byte order."""
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    out, n = {}, 0
    for b in range(256):
        if b in printable:
            code = b
        else:
            code, n = 256 + n, n + 1
        if b < 128:
            out[b] = chr(code)
    return out


_BYTE_LEVEL = _ascii_byte_level()


def word_tokenizer(model: Any) -> Callable[[str], list[int]]:
    """``word -> ids`` straight from a byte-level BPE ``model`` (a ``tokenizers`` model):
    the word's bytes as the ``ByteLevel`` pre-tokenizer maps them, then the model, which
    is all the library does to one word with no added token in it. A tenth of the
    library's whole-pipeline ``encode`` of one word on a cold cache (about 45 us there)."""
    tokenize = model.tokenize
    table = _BYTE_LEVEL
    return lambda word: [t.id for t in tokenize(word.translate(table))]


# Translated patterns the compiled split (_split.pyx) follows exactly.
_COMPILED = {ascii_pattern(GPT2_PATTERN).pattern: GPT2,  # type: ignore[union-attr]
             ascii_pattern(LLAMA3_PATTERN).pattern: LLAMA3,  # type: ignore[union-attr]
             ascii_pattern(QWEN2_PATTERN).pattern: QWEN2}  # type: ignore[union-attr]


class WordEncoder:
    """Ids of ASCII pieces from a word cache; see the module docstring.

    ``pattern``: the ASCII split (:func:`split_pattern`); ``encode_many``: texts -> the
    library's encodings, no special tokens added; ``added``: every added token's content
    -> (id, matched exactly: no lstrip/rstrip/single_word).
    """

    def __init__(self, pattern: re.Pattern[str], encode_many: Callable[[list[str]], Sequence[Any]],
                 added: dict[str, tuple[int, bool]], max_words: int = 200_000,
                 encode_one: Callable[[str], Sequence[int]] | None = None,
                 encode_word: Callable[[str], list[int]] | None = None) -> None:
        self._pattern = pattern
        self._findall = pattern.findall
        # The compiled split of a common pattern (see _split.pyx), else Python's re.
        self._kind = _COMPILED.get(pattern.pattern)
        self._encode_many = encode_many
        # New words in one call of the library's single-text encode, joined by an exactly
        # matched added token: the library cuts there and encodes each word on its own,
        # as alone. One call on this thread: a batch of a few short words costs 3-6x more
        # (the library hands a batch to its thread pool).
        exact = sorted((t, i) for t, (i, ok) in added.items() if ok and t)
        self._encode_one = encode_one
        self._encode_word = encode_word  # one new word (a few): see word_tokenizer
        self._sep = exact[0] if exact else None
        self._max_words = max_words
        self._cache: dict[str, bytes] = {}
        # Longest first, as the library's leftmost-longest added-token matcher.
        tokens = sorted(added, key=len, reverse=True)
        self._added = re.compile("|".join(map(re.escape, tokens))) if tokens else None
        self._exact = {t: i for t, (i, exact) in added.items() if exact}
        self.pieces = 0  # pieces encoded here (the rest went to the library)

    @property
    def words(self) -> int:
        return len(self._cache)

    def encode(self, piece: str) -> array | None:
        """Ids of ``piece`` (no special tokens added), or None: encode it with the library."""
        if len(piece) > MAX_PIECE_CHARS or not piece.isascii():
            return None
        tail = None
        if self._added is not None:
            m = self._added.search(piece)
            if m is not None:
                # Only an exactly matched token that ends the piece (and starts the first
                # match, so no other token overlaps it) is cut off; anything else: library.
                tail = self._exact.get(m.group())
                if tail is None or m.end() != len(piece):
                    return None
                piece = piece[:m.start()]
        cache = self._cache
        if self._kind is not None:
            # (None: text not stored as ASCII, or new words the cache does not take)
            blob = join_cached(piece, cache, self._kind, partial(self._learn, cache=cache))
        else:
            words = self._findall(piece)
            if sum(map(len, words)) != len(piece):  # a character no alternative matched
                return None
            blob = self._join(words, cache)
        if blob is None:
            return None
        out = array("q")
        out.frombytes(blob)
        if tail is not None:
            out.append(tail)
        self.pieces += 1
        return out

    def _join(self, words: list[str], cache: dict[str, bytes]) -> bytes | None:
        """The ids of ``words`` joined, the new ones encoded and cached first; None when
        they are too many or too long for the cache."""
        try:
            return b"".join(map(cache.__getitem__, words))
        except KeyError:
            if self._learn(list(set(words).difference(cache)), cache) is None:
                return None
            return b"".join(map(cache.__getitem__, words))

    def _learn(self, missing: list[str], cache: dict[str, bytes]) -> list[bytes] | None:
        """Encode ``missing`` into ``cache`` (this call's dict: the next one starts an
        empty dict when this one is full); their ids, or None when they are too many or
        too long."""
        if len(missing) > self._max_words or max(map(len, missing)) > MAX_WORD_CHARS:
            return None
        ids = list(self._encode_words(missing))
        cache.update(zip(missing, ids))
        if len(cache) > self._max_words:
            self._cache = {}  # readers of the old dict keep it until they finish
        return ids

    def _encode_words(self, words: list[str]) -> Iterable[bytes]:
        """Each word's ids as int64 bytes: a few by the model one by one, more in one
        call of the library (joined by an added token), else in one batch."""
        if self._encode_word is not None and len(words) <= _FEW_WORDS:
            encode_word = self._encode_word
            return [array("q", encode_word(w)).tobytes() for w in words]
        encode = self._encode_one
        if encode is not None and len(words) == 1:
            return [array("q", encode(words[0])).tobytes()]
        if encode is not None and self._sep is not None:
            sep, sep_id = self._sep
            ids = np.asarray(encode(sep.join(words)), dtype=np.int64)
            cuts = np.flatnonzero(ids == sep_id)
            if len(cuts) == len(words) - 1:  # else an added token spans a join: batch
                blob = ids.tobytes()
                starts = np.concatenate(([0], cuts + 1)) * 8
                ends = np.append(cuts, len(ids)) * 8
                return map(blob.__getitem__, map(slice, starts.tolist(), ends.tolist()))
        return map(_tobytes, map(array, repeat("q"), map(_ids, self._encode_many(words))))

    def self_check(self, reference: Callable[[str], list[int]], split_tokens: Sequence[str]) -> bool:
        """True when this path gives ``reference(text)`` for every probe text it takes
        (and takes most of them): ASCII words, digits, contractions, punctuation and
        whitespace runs, control characters, random ASCII, each also ended by a split
        token. Leaves the cache empty."""
        rng = random.Random(0)
        alphabet = [chr(c) for c in range(128)]
        fixed = ["", "Hello, world!  It's 2 o'clock\n\tdone", "I'LL SAY: they'RE 'S 'll 've 'd 'm 't",
                 "x = 12345678 + 0.5e-3;  // 1 22 333 4444\r\n\r\n  \n\n\t\t end  ",
                 "def f(a, b):\n    return a+b  # ok?!\n\n\n", "   lead and trail   ", "\x0b\x0c\x1c\x1f\x7f\x00 z",
                 "--==>>  ...  ''  \"\" 's'S's 'Ss 99'sx", "a\nb\r\nc \n d\t\te"]
        probes = fixed + ["".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
                          for _ in range(300)]
        probes += [p + t for p in probes[:40] for t in split_tokens[:2]]
        taken = 0
        try:
            for text in probes:
                got = self.encode(text)
                if got is None:
                    continue
                taken += 1
                if got.tolist() != reference(text):
                    return False
            # Each way new words are encoded (one by one, joined, a batch), on every word.
            words = sorted(set(self._cache))
            want = [array("q", reference(w)).tobytes() for w in words]
            for few in (True, False):
                if list(self._encode_words(words[:_FEW_WORDS] if few else words)) != \
                        (want[:_FEW_WORDS] if few else want):
                    return False
        finally:
            self._cache = {}
            self.pieces = 0
        return taken * 2 >= len(probes)
