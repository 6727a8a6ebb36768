"""How many characters of input text one token of a tokenizer can stand for, at most
(:func:`token_chars_bound`): a text with more characters than ``n`` times that has more
than ``n`` tokens, so :mod:`kvevents.text.limits` refuses it without tokenizing it.

Pure: reads a Hugging Face ``tokenizers.Tokenizer``'s pipeline (normalizer,
pre-tokenizer, model, vocabulary), imports nothing of kvevents (the tokenizer module
calls it without an import circle).
"""

from __future__ import annotations

import json

__all__ = ["token_chars_bound"]

#: Normalizers that never make a text shorter, and the Unicode compositions, which make
#: it at most 4 times shorter (the longest canonical decomposition has 4 characters).
_KEEPS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSES = frozenset({"NFC", "NFKC"})
#: Pre-tokenizers that keep every character (others may drop some: whitespace splits).
_PRE_KEEPS = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})


def token_chars_bound(tokenizer) -> int | None:
    """The most characters of input text one token of ``tokenizer`` (a Hugging Face
    ``tokenizers.Tokenizer``) can stand for, or None when its pipeline may drop text
    (so no bound holds): its longest vocabulary or added token's string (a byte-level
    token's string has one character per byte), times 4 when its normalizer composes
    Unicode (NFC, NFKC), or times a ``Replace``'s shrinking. Refused as None: other
    normalizers (stripping accents or spaces), pre-tokenizers that remove what they
    split on, and models whose unknown token may stand for a run of unknown characters
    (BPE or Unigram fusing unknowns without byte fallback, WordPiece). Computed once per
    tokenizer (a pass over its vocabulary: milliseconds)."""
    def state(component) -> dict | None:
        return None if component is None else json.loads(component.__getstate__())

    factor = _normalizer_factor(state(tokenizer.normalizer))
    if factor is None or not _pre_keeps(state(tokenizer.pre_tokenizer)):
        return None
    model = tokenizer.model
    kind = type(model).__name__
    if kind == "WordPiece" or kind not in ("BPE", "Unigram", "WordLevel"):
        return None
    if kind == "BPE" and getattr(model, "fuse_unk", False) and not getattr(model, "byte_fallback", False):
        return None
    if kind == "Unigram" and not getattr(model, "byte_fallback", False) \
            and state(model).get("unk_id") is not None:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * factor


def _normalizer_factor(state: dict | None) -> int | None:
    if state is None:
        return 1
    kind = state.get("type")
    if kind == "Sequence":
        factor = 1
        for part in state.get("normalizers", ()):
            got = _normalizer_factor(part)
            if got is None:
                return None
            factor *= got
        return factor
    if kind in _KEEPS:
        return 1
    if kind in _COMPOSES:
        return 4
    if kind == "Replace":
        pattern, content = state.get("pattern", {}), state.get("content", "")
        if "String" not in pattern or not content:
            return None  # a regex, or a deletion: no bound
        return max(1, -(-len(pattern["String"]) // len(content)))
    return None


def _pre_keeps(state: dict | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_pre_keeps(p) for p in state.get("pretokenizers", ()))
    if state.get("behavior") == "Removed":  # (Split, Punctuation: what they split on goes)
        return False
    return kind in _PRE_KEEPS or kind == "Split"
