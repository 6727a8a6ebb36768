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

The split runs in Python's ``re`` on ASCII pieces up to 16 KiB, where the Unicode classes the
patterns use reduce to plain ranges (``\\p{L}`` to ``A-Za-z``, ``\\p{N}`` to ``0-9``) and
``\\s`` means the same in both engines. Text with any other character, text that holds an
added token's content (other than one split token at the end of a piece, as
:class:`~kvevents.text.segments.SegmentEncoder` cuts them), or a pattern with syntax not
translated here (line anchors, other Unicode classes, nested classes) returns None and
the caller encodes it with the library. :meth:`WordEncoder.self_check` compares both
ways on probe texts at load; any difference disables the path.

Why it pays: the library's regex split costs about 0.3 us per character (150 us for a
500-character user turn); this path costs a fifth of that once the words are known.
No Python runs per word or per token: the split, the cache lookups and the join are C
calls over the whole text.

Memory: at most ``max_words`` cached words (their ids as int64 bytes); past that the
cache starts again empty. Thread-safe: a reader holds its own reference to the dict it
read from, and a dict that is replaced is dropped when its last reader finishes.
"""

from __future__ import annotations

import random
import re
from array import array
from collections.abc import Callable, Sequence
from itertools import repeat
from operator import attrgetter
from typing import Any

# tokenizers' ByteLevel pre-tokenizer with use_regex=true splits with this (byte_level.rs).
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Unicode classes as their ASCII members ("": none in ASCII).
_ASCII_CLASSES = {"L": "A-Za-z", "Lu": "A-Z", "Ll": "a-z", "Lt": "", "Lm": "", "Lo": "",
                  "N": "0-9", "Nd": "0-9", "Nl": "", "No": "",
                  "M": "", "Mn": "", "Mc": "", "Me": ""}

MAX_WORD_CHARS = 256  # a longer word (a run of spaces, a base64 blob) goes to the library
# A longer piece goes to the library, which releases the GIL while it runs (this path holds
# it): a long prompt encoded on a worker thread must leave the event loop serving.
MAX_PIECE_CHARS = 16 * 1024
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


class WordEncoder:
    """Ids of ASCII pieces from a word cache; see the module docstring.

    ``pattern``: the ASCII split (:func:`split_pattern`); ``encode_many``: texts -> the
    library's encodings, no special tokens added; ``added``: every added token's content
    -> (id, matched exactly: no lstrip/rstrip/single_word).
    """

    def __init__(self, pattern: re.Pattern[str], encode_many: Callable[[list[str]], Sequence[Any]],
                 added: dict[str, tuple[int, bool]], max_words: int = 200_000) -> None:
        self._pattern = pattern
        self._findall = pattern.findall
        self._encode_many = encode_many
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
        words = self._findall(piece)
        if sum(map(len, words)) != len(piece):  # a character no alternative matched
            return None
        cache = self._cache
        try:
            blob = b"".join(map(cache.__getitem__, words))
        except KeyError:
            missing = list(set(words).difference(cache))
            if len(missing) > self._max_words or max(map(len, missing)) > MAX_WORD_CHARS:
                return None
            encoded = self._encode_many(missing)
            cache.update(zip(missing, map(_tobytes, map(array, repeat("q"), map(_ids, encoded)))))
            blob = b"".join(map(cache.__getitem__, words))
            if len(cache) > self._max_words:
                self._cache = {}  # readers of the old dict keep it until they finish
        out = array("q")
        out.frombytes(blob)
        if tail is not None:
            out.append(tail)
        self.pieces += 1
        return out

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
        finally:
            self._cache = {}
            self.pieces = 0
        return taken * 2 >= len(probes)
