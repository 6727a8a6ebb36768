"""Encode text piece by piece, split after special tokens, with an LRU of pieces.

Why this is exact: the ``tokenizers`` library itself first cuts the input at its added
tokens and encodes the text between them independently. Cutting right after a
*special* token that is matched on raw text (``normalized=False``) and strips nothing
around it (no ``lstrip``/``rstrip``/``single_word``) therefore yields pieces whose ids
concatenate to the ids of the whole text. Tokenizers for which that does not hold
(a pre-tokenizer that treats the first piece differently, ``prepend_scheme="first"``)
are detected at load and encoded whole; :meth:`SegmentEncoder.self_check` also
compares piecewise and whole encodings of a probe before piecewise encoding is used.

Why it pays: chat templates end every turn with a special token, so a conversation
that grows by a turn re-uses the cached ids of every earlier turn and encodes only the
new text. Identical prompts hit the cache whole.

How new text is encoded: an ASCII piece up to 16 KiB of a regex-split byte-level BPE
tokenizer from the word cache of :mod:`kvevents.text.words` (a fifth of the library's
cost for a new user turn whose words are known; exact, checked at load). Every other
new piece of a call goes to the library in one ``encode_batch_fast`` (the batch call
that computes no character offsets, which we never read: about 30% less CPU than
``encode`` for a 280-token turn), which also releases the GIL while the Rust code runs,
so a long prompt encoded on a worker thread leaves the event loop serving (``encode``
holds the GIL for its whole run: 190 ms of stall for a 180 KB text;
``benchmarks/bench_tokenize.py`` measures both). The library spreads a batch over its
own thread pool unless ``TOKENIZERS_PARALLELISM`` says no; ``kvevents serve`` says no
(its requests already use every core), so the call runs on the caller's thread.

Memory: the LRU holds at most ``max_tokens`` ids (8 bytes each, ``array('q')``) and
evicts least recently used pieces beyond that. Thread-safe (one lock around the LRU;
encoding runs outside it).
"""

from __future__ import annotations

import re
import threading
from array import array
from collections import OrderedDict
from typing import Any

from kvevents.text.words import WordEncoder


def batch_encoder(tokenizer: Any) -> Any:
    """``texts -> encodings`` without special tokens: ``encode_batch_fast`` (tokenizers
    0.21+: no offsets), else ``encode_batch``; both release the GIL."""
    fast = getattr(tokenizer, "encode_batch_fast", None)
    call = fast if fast is not None else tokenizer.encode_batch
    return lambda texts: call(texts, add_special_tokens=False)


class SegmentEncoder:
    """Encodes text with ``tokenizer`` (a ``tokenizers.Tokenizer``), no special tokens added.

    ``split_tokens``: contents of the special tokens after which text may be cut;
    empty disables piecewise encoding (whole texts are still cached).
    """

    def __init__(self, tokenizer: Any, split_tokens: list[str], max_tokens: int = 2_000_000,
                 max_piece_chars: int = 1 << 20, words: WordEncoder | None = None) -> None:
        self._tok = tokenizer
        self._words = words  # new ASCII pieces from a word cache (see words.py), if it applies
        self._max_tokens = max_tokens
        self._max_piece_chars = max_piece_chars  # longer pieces are encoded, not cached
        self._encode_many = batch_encoder(tokenizer)
        # Longest first: the regex alternation then prefers the longest token at a spot,
        # as the tokenizer's own leftmost-longest matcher does.
        tokens = sorted(set(split_tokens), key=len, reverse=True)
        self._split = re.compile("|".join(re.escape(t) for t in tokens)) if tokens else None
        self._lru: OrderedDict[str, array] = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def piecewise(self) -> bool:
        return self._split is not None

    def disable_pieces(self) -> None:
        self._split = None

    def pieces(self, text: str) -> list[str]:
        """``text`` cut right after each split token (the pieces concatenate to it)."""
        if self._split is None:
            return [text]
        out, start = [], 0
        for m in self._split.finditer(text):
            out.append(text[start:m.end()])
            start = m.end()
        if start < len(text) or not out:
            out.append(text[start:])
        return out

    def encode(self, text: str) -> array:
        """Ids of ``text`` (no special tokens added), as ``array('q')``."""
        parts = self.pieces(text)
        found: list[array | None] = [None] * len(parts)
        missing: list[int] = []
        with self._lock:
            for i, p in enumerate(parts):
                ids = self._lru.get(p)
                if ids is None:
                    missing.append(i)
                else:
                    self._lru.move_to_end(p)
                    found[i] = ids
            self.hits += len(parts) - len(missing)
            self.misses += len(missing)
        if missing:
            fresh = []
            if self._words is not None:  # a loop per new piece (a turn), not per word
                rest = []
                for i in missing:
                    ids = self._words.encode(parts[i])
                    if ids is None:
                        rest.append(i)
                    else:
                        found[i] = ids
                        fresh.append((parts[i], ids))
                missing = rest
            if missing:
                encoded = self._encode_many([parts[i] for i in missing])  # GIL released
                for i, enc in zip(missing, encoded):
                    found[i] = ids = array("q", enc.ids)
                    fresh.append((parts[i], ids))
            self._remember(fresh)
        if len(found) == 1:  # a copy: the cached array must not be changed by callers
            return array("q", found[0])  # type: ignore[arg-type]
        out = array("q")
        for ids in found:
            out.extend(ids)  # type: ignore[arg-type]
        return out

    def _remember(self, fresh: list[tuple[str, array]]) -> None:
        with self._lock:
            for piece, ids in fresh:
                if len(piece) > self._max_piece_chars or len(ids) > self._max_tokens:
                    continue
                old = self._lru.pop(piece, None)
                if old is not None:
                    self._held -= len(old)
                self._lru[piece] = ids
                self._held += len(ids)
            while self._held > self._max_tokens and self._lru:
                _, ids = self._lru.popitem(last=False)
                self._held -= len(ids)

    def self_check(self, probe: str) -> bool:
        """True when piecewise encoding of ``probe`` equals encoding it whole."""
        whole = self._tok.encode(probe, add_special_tokens=False).ids
        parts = self._encode_many(self.pieces(probe))  # the call encode() makes
        return [i for enc in parts for i in enc.ids] == whole

    def stats(self) -> dict[str, int]:
        """Pieces and ids held, piece hits and misses, and of the misses how many were
        encoded from the word cache (``word_pieces``; ``words``: words it holds)."""
        words = self._words
        with self._lock:
            return {"pieces": len(self._lru), "tokens": self._held, "hits": self.hits,
                    "misses": self.misses, "word_pieces": words.pieces if words else 0,
                    "words": words.words if words else 0}
