# cython: language_level=3, boundscheck=False, wraparound=False
"""A compiled reader of the common ``POST /v1/lookup`` body, ids straight to an array.

Why: routers send ``{"token_ids": [...]}`` with thousands of ids. msgspec's typed
decode builds a Python int per id (about 125 us for 2,048 ids here, a sixth of the
event loop's time per lookup), and the index then converts them back to int64. This
reads the ids into an ``array('q')``, which the index's core reads in place.

Only the common shape is read: a JSON object whose keys are ``token_ids`` (required;
an array of ids written as plain decimal integers in [0, 2^32 - 1]) and optionally
``model`` / ``lora_name`` (``null`` or strings of printable ASCII without escapes),
each at most once, with JSON whitespace anywhere between tokens. Anything else
returns None and the caller decodes with msgspec, which defines validity and writes
the error messages (tests/test_fastbody.py checks the two agree).
"""

from array import array

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint64_t
from libc.stdlib cimport realloc, free

cdef uint64_t _MAX_ID = 4294967295ULL  # TokenId's bound in body.py


cdef extern from *:
    """
    #include <string.h>
    /* The decimal number that starts at p (p[0] is a digit; 8 bytes readable): its
       digit count, its value in *out. 0 when all 8 bytes are digits (the caller reads
       it digit by digit). Why: digit by digit, the loop's exit at each number's end is
       a branch that ids of 1 to 6 digits keep mispredicting. Here the count comes from
       a mask of the non-digit bytes and the value from three multiplications (the SWAR
       conversion of eight digits, the missing leading digits read as zeros): a 2,048-id
       body in 12.5-13.9 us against 15.1-16.6 us; the rest is the walk's dependency from
       one id's length to the next id's load. */
    static inline int kv_digits8(const char* p, unsigned long long* out) {
        unsigned long long x, nd;
        int k;
        memcpy(&x, p, 8);
    #if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        x = __builtin_bswap64(x);
    #endif
        /* A byte is a digit when its high nibble is 3 and its low nibble is at most 9;
           nd has a non-zero byte exactly where p has a non-digit (no carries). */
        nd = ((x & 0xF0F0F0F0F0F0F0F0ULL) ^ 0x3030303030303030ULL)
           | (((x & 0x0F0F0F0F0F0F0F0FULL) + 0x0606060606060606ULL) & 0xF0F0F0F0F0F0F0F0ULL);
        if (nd == 0) return 0;
        k = __builtin_ctzll(nd) >> 3;
        if (k == 0) return 0;
        x <<= (8 - k) * 8;
        x = ((x & 0x0F0F0F0F0F0F0F0FULL) * 2561) >> 8;
        x = ((x & 0x00FF00FF00FF00FFULL) * 6553601) >> 16;
        *out = ((x & 0x0000FFFF0000FFFFULL) * 42949672960001ULL) >> 32;
        return k;
    }
    """
    int kv_digits8(const char* p, uint64_t* out) noexcept nogil


# Characters are compared by code (Cython would otherwise compare bytes objects).
cdef inline Py_ssize_t _ws(const char* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    while i < n and (p[i] == 32 or p[i] == 9 or p[i] == 10 or p[i] == 13):
        i += 1
    return i


cdef inline Py_ssize_t _plain_string(const char* p, Py_ssize_t i, Py_ssize_t n) noexcept nogil:
    """``p[i]`` opens a string of printable ASCII without escapes: the index of its
    closing quote, else -1."""
    cdef unsigned char c
    if i >= n or p[i] != 34:
        return -1
    i += 1
    while i < n:
        c = <unsigned char>p[i]
        if c == 34:
            return i
        if c == 92 or c < 0x20 or c >= 0x7F:
            return -1
        i += 1
    return -1


def lookup_body(bytes raw):
    """``(token_ids: array('q'), model, lora_name)`` when ``raw`` is a lookup body of
    the common shape, else None (decode it with msgspec). Never raises for content."""
    cdef const char* p = PyBytes_AS_STRING(raw)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(raw)
    cdef Py_ssize_t i, j, k, m
    cdef int seen = 0, bit
    cdef uint64_t v
    cdef int64_t* ids = NULL
    cdef Py_ssize_t n_ids = 0, cap = 0
    cdef int64_t* grown
    model = None
    lora = None
    i = _ws(p, 0, n)
    if i >= n or p[i] != 123:
        return None
    i = _ws(p, i + 1, n)
    try:
        while True:
            j = _plain_string(p, i, n)
            if j < 0:
                return None
            k = j - i - 1  # key length
            if k == 9 and p[i + 1:j] == b"token_ids":
                bit = 1
            elif k == 5 and p[i + 1:j] == b"model":
                bit = 2
            elif k == 9 and p[i + 1:j] == b"lora_name":
                bit = 4
            else:
                return None  # unknown keys are msgspec's to refuse
            if seen & bit:
                return None  # a repeated key: msgspec decides
            seen |= bit
            i = _ws(p, j + 1, n)
            if i >= n or p[i] != 58:
                return None
            i = _ws(p, i + 1, n)
            if bit == 1:
                if i >= n or p[i] != 91:
                    return None
                i = _ws(p, i + 1, n)
                if i < n and p[i] == 93:
                    i += 1
                else:
                    while True:
                        if i >= n or not (48 <= p[i] <= 57):
                            return None
                        if p[i] == 48 and i + 1 < n and 48 <= p[i + 1] <= 57:
                            return None  # a leading zero is not JSON
                        # Up to 7 digits with one load and no branch on their
                        # count; longer ids, and the last 7 bytes, digit by digit.
                        k = kv_digits8(p + i, &v) if i + 8 <= n else 0
                        if k:
                            i += k
                        else:
                            v = 0
                            m = i
                            while i < n and 48 <= p[i] <= 57:
                                if i - m >= 10:
                                    return None
                                v = v * 10 + <uint64_t>(p[i] - 48)  # '0'
                                i += 1
                        if v > _MAX_ID or (i < n and (p[i] == 46 or p[i] == 101 or p[i] == 69)):
                            return None
                        if n_ids == cap:
                            cap = cap * 2 if cap else 4096
                            grown = <int64_t*>realloc(ids, cap * sizeof(int64_t))
                            if grown == NULL:
                                raise MemoryError()
                            ids = grown
                        ids[n_ids] = <int64_t>v
                        n_ids += 1
                        i = _ws(p, i, n)
                        if i < n and p[i] == 44:
                            i = _ws(p, i + 1, n)
                            continue
                        if i < n and p[i] == 93:
                            i += 1
                            break
                        return None
            else:
                if n - i >= 4 and p[i:i + 4] == b"null":
                    value = None
                    i += 4
                else:
                    j = _plain_string(p, i, n)
                    if j < 0:
                        return None
                    value = p[i + 1:j].decode("ascii")
                    i = j + 1
                if bit == 2:
                    model = value
                else:
                    lora = value
            i = _ws(p, i, n)
            if i < n and p[i] == 44:
                i = _ws(p, i + 1, n)
                continue
            if i < n and p[i] == 125:
                break
            return None
        if _ws(p, i + 1, n) != n or not (seen & 1):
            return None
        out = array("q")
        if n_ids:
            out.frombytes((<char*>ids)[:n_ids * sizeof(int64_t)])
        return out, model, lora
    finally:
        free(ids)
