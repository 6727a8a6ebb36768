# cython: language_level=3, boundscheck=False, wraparound=False
"""The word split of the common byte-level BPE patterns on ASCII text, and the join of
the words' cached ids, in one compiled call (see :mod:`kvevents.text.words`).

Why: Python's ``re`` walks the pattern's alternatives at every character; for a new
500-character user turn that was most of the cost of its ids (about 21 us of 30 hot,
more on a cold cache). Here the split is a state machine over the string's bytes, and
each word is looked up in the cache as it is found; new words are encoded in one
call and the ids joined, with no second walk.

Which patterns: ``GPT2`` (tokenizers' ``ByteLevel`` regex: GPT-2, RoBERTa...),
``LLAMA3`` (Llama 3, DeepSeek-style ``Split`` regexes with ``\\p{N}{1,3}``) and ``QWEN2``
(the same with one digit per word). Each follows its regex's alternatives in order as
Python's ``re`` does on ASCII (``\\s``: space, ``\\t``, ``\\n``, ``\\r``, ``\\v``, ``\\f``);
:class:`kvevents.text.words.WordEncoder` picks one only for a tokenizer whose translated
pattern equals that regex, and the tests compare both on random ASCII. The caller checks that the text
is ASCII (:func:`split` refuses other text, :func:`join_cached` returns None).

A cache value that is not bytes is a TypeError.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

cdef extern from "Python.h":
    const unsigned char *PyUnicode_1BYTE_DATA(object)
    bint PyUnicode_IS_COMPACT_ASCII(object)
    object PyUnicode_Substring(object, Py_ssize_t, Py_ssize_t)
    PyObject *PyDict_GetItemWithError(object, object) except? NULL

cdef enum:
    _GPT2 = 0
    _LLAMA3 = 1
    _QWEN2 = 2

GPT2 = _GPT2
LLAMA3 = _LLAMA3
QWEN2 = _QWEN2

DEF LETTER = 1
DEF DIGIT = 2
DEF SPACE = 3  # \s
DEF OTHER = 4  # none of the above

cdef unsigned char _CLS[128]


cdef void _init_classes() noexcept:
    cdef int c
    for c in range(128):
        if (65 <= c <= 90) or (97 <= c <= 122):
            _CLS[c] = LETTER
        elif 48 <= c <= 57:
            _CLS[c] = DIGIT
        elif c == 32 or 9 <= c <= 13:
            _CLS[c] = SPACE
        else:
            _CLS[c] = OTHER


_init_classes()


cdef inline Py_ssize_t _run(const unsigned char *s, Py_ssize_t i, Py_ssize_t n,
                            unsigned char cls) noexcept nogil:
    while i < n and _CLS[s[i]] == cls:
        i += 1
    return i


cdef inline Py_ssize_t _contraction(const unsigned char *s, Py_ssize_t i, Py_ssize_t n,
                                    bint fold) noexcept nogil:
    """End of ``'s|'t|'re|'ve|'m|'ll|'d`` at ``i`` (``fold``: any case), else -1."""
    cdef unsigned char a, b
    if s[i] != 39 or i + 1 >= n:  # '
        return -1
    a = s[i + 1]
    if fold and 65 <= a <= 90:
        a += 32
    if a == 115 or a == 116 or a == 109 or a == 100:  # s t m d
        return i + 2
    if i + 2 >= n:
        return -1
    b = s[i + 2]
    if fold and 65 <= b <= 90:
        b += 32
    if (a == 114 and b == 101) or (a == 118 and b == 101) or (a == 108 and b == 108):  # re ve ll
        return i + 3
    return -1


cdef inline Py_ssize_t _spaces(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """``\\s+(?!\\S)|\\s+`` at ``i`` (a whitespace character)."""
    cdef Py_ssize_t k = _run(s, i, n, SPACE)
    if k < n and k - i >= 2:
        return k - 1  # the last one goes with the word after it
    return k


cdef Py_ssize_t _gpt2(const unsigned char *s, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``"""
    cdef Py_ssize_t j = _contraction(s, i, n, False)
    cdef unsigned char cls
    if j >= 0:
        return j
    j = i
    if s[i] == 32 and i + 1 < n and _CLS[s[i + 1]] != SPACE:
        j = i + 1
    cls = _CLS[s[j]]
    if cls != SPACE:
        return _run(s, j, n, cls)
    return _spaces(s, i, n)


cdef Py_ssize_t _llama3(const unsigned char *s, Py_ssize_t i, Py_ssize_t n,
                        Py_ssize_t max_digits) noexcept nogil:
    """``(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,MAX}|
    ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+``"""
    cdef Py_ssize_t j = _contraction(s, i, n, True)
    cdef Py_ssize_t k, p
    cdef unsigned char c = s[i]
    cdef unsigned char cls = _CLS[c]
    if j >= 0:
        return j
    if cls == LETTER:
        return _run(s, i, n, LETTER)
    if cls != DIGIT and c != 13 and c != 10 and i + 1 < n and _CLS[s[i + 1]] == LETTER:
        return _run(s, i + 1, n, LETTER)
    if cls == DIGIT:
        k = i
        while k < n and k - i < max_digits and _CLS[s[k]] == DIGIT:
            k += 1
        return k
    j = i
    if c == 32 and i + 1 < n and _CLS[s[i + 1]] == OTHER:
        j = i + 1
    if _CLS[s[j]] == OTHER:
        k = _run(s, j, n, OTHER)
        while k < n and (s[k] == 13 or s[k] == 10):
            k += 1
        return k
    # whitespace: up to the last line break of the run, else as GPT-2
    k = _run(s, i, n, SPACE)
    p = k - 1
    while p >= i:
        if s[p] == 13 or s[p] == 10:
            return p + 1
        p -= 1
    return _spaces(s, i, n)


cdef inline Py_ssize_t _next(const unsigned char *s, Py_ssize_t i, Py_ssize_t n,
                             int kind) noexcept nogil:
    if kind == _GPT2:
        return _gpt2(s, i, n)
    return _llama3(s, i, n, 3 if kind == _LLAMA3 else 1)


def split(str text, int kind):
    """``text`` (ASCII) cut into words as the pattern ``kind`` cuts it."""
    if not PyUnicode_IS_COMPACT_ASCII(text):
        raise ValueError("split takes ASCII text")
    cdef const unsigned char *s = PyUnicode_1BYTE_DATA(text)
    cdef Py_ssize_t n = len(text), i = 0, j
    out = []
    while i < n:
        j = _next(s, i, n, kind)
        out.append(PyUnicode_Substring(text, i, j))
        i = j
    return out


def join_cached(str text, dict cache, int kind, learn=None):
    """The concatenated cached ids (bytes) of ``text``'s words. Words not in ``cache``
    (each once, in order of first appearance) go to ``learn(words)``, which returns
    their ids as bytes, in order (caching them is its business), or None to give up
    (then None is returned); with no ``learn``, the list of those words is returned.
    None also for text not stored as ASCII."""
    if not PyUnicode_IS_COMPACT_ASCII(text):
        return None
    cdef const unsigned char *s = PyUnicode_1BYTE_DATA(text)
    cdef Py_ssize_t n = len(text), i = 0, j, m = 0, k, total = 0, size, misses = 0
    cdef PyObject *value
    cdef char *dst
    cdef list missing = None
    cdef set seen
    # Each word's value (a new reference; NULL for a word not in the cache, whose span
    # is kept in ``spans``), so the words are walked once even when some are new.
    cdef PyObject **found = <PyObject **>calloc(n + 1, sizeof(PyObject *))
    cdef Py_ssize_t *spans = <Py_ssize_t *>malloc((3 * n + 3) * sizeof(Py_ssize_t))
    if found == NULL or spans == NULL:
        free(found)
        free(spans)
        raise MemoryError()
    try:
        while i < n:
            j = _next(s, i, n, kind)
            word = PyUnicode_Substring(text, i, j)
            value = PyDict_GetItemWithError(cache, word)
            if value == NULL:
                if missing is None:
                    missing, seen = [], set()
                if word not in seen:
                    seen.add(word)
                    missing.append(word)
                spans[3 * misses] = m
                spans[3 * misses + 1] = i
                spans[3 * misses + 2] = j
                misses += 1
            else:
                if not isinstance(<object>value, bytes):
                    raise TypeError("cache values must be bytes")
                Py_INCREF(<object>value)
                found[m] = value
                total += PyBytes_GET_SIZE(<object>value)
            m += 1
            i = j
        if missing is not None:
            if learn is None:
                return missing
            got = learn(missing)
            if got is None:
                return None
            new = dict(zip(missing, got))
            for k in range(misses):
                value_obj = new[PyUnicode_Substring(text, spans[3 * k + 1], spans[3 * k + 2])]
                if not isinstance(value_obj, bytes):
                    raise TypeError("learn must return bytes")
                Py_INCREF(value_obj)
                found[spans[3 * k]] = <PyObject *>value_obj
                total += PyBytes_GET_SIZE(value_obj)
        out = PyBytes_FromStringAndSize(NULL, total)
        dst = PyBytes_AS_STRING(out)
        for j in range(m):
            size = PyBytes_GET_SIZE(<object>found[j])
            memcpy(dst, PyBytes_AS_STRING(<object>found[j]), size)
            dst += size
        return out
    finally:
        for j in range(m):
            if found[j] != NULL:
                Py_DECREF(<object>found[j])
        free(found)
        free(spans)
