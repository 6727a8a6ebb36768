# Included by _core.pyx: the compiled reader of the common shape of vLLM's wire batch.
#
# Why: decoding a batch with msgspec builds a Python object per event, per hash list
# and per field, and the core then reads them back attribute by attribute; on a stream
# of small decode-step batches that was a third of the aggregator's ingest thread.
# This reader walks the msgpack bytes instead, twice: ``scan`` (when the subscriber
# receives a payload) checks that the whole batch is of the common shape and reads its
# ``ts``; ``Core._apply_wire`` (under the index lock) reads each event again and
# applies it straight from the bytes.
#
# The common shape, and nothing else, is read here: ``[ts, [event, ...], dp_rank?]``
# with map-encoded events (``"type"`` first), int block hashes, an int array of token
# ids covering every block, ``lora_id`` / ``lora_name`` / ``extra_keys`` absent or nil
# (``extra_keys`` may be a list of nils), ``cache_salt`` absent or nil, ``locality`` not
# ``"REMOTE"``, and ASCII strings. Anything else (legacy array
# events, bytes hashes, LoRA, extra keys, token-less stores, unknown event types, odd
# values in fields nobody reads, malformed bytes) makes ``scan`` return None and the
# batch takes the general path (``schema.BatchDecoder`` + ``Core._apply_events``),
# which defines the semantics: a batch this reader accepts must decode there to the
# same events (tests/index/test_wire.py checks both paths give identical index states,
# counters and refusals, on generated and mutated payloads).
#
# All readers below are bounded by ``end`` and return -1 ("not the common shape") on
# anything unexpected, including truncation; they never read past the buffer.

DEF EV_STORED = 1
DEF EV_REMOVED = 2
DEF EV_CLEARED = 3
DEF MAX_SKIP_DEPTH = 16

ctypedef struct WEvent:
    int kind
    bint feeds              # full attention (what prefix matching uses)
    Py_ssize_t hpos         # first element of block_hashes
    int64_t n               # number of block hashes
    bint has_parent
    bint parent_neg
    uint64_t parent
    Py_ssize_t tpos         # first element of token_ids
    int64_t n_tok
    bint h_read             # the hashes were read into the caller's buffer
    bint h_neg              # some hash is negative (SGLang's signed int64)
    bint t_read             # the token ids were read into the caller's buffer
    int64_t hoff            # (staged) where its hashes start in the stage's array
    int64_t toff            # (staged) where its tokens start in the stage's array
    int64_t bs
    Py_ssize_t mpos         # medium's bytes (-1: nil or absent = GPU)
    Py_ssize_t mlen


# What the wire path has resolved for one engine's model: medium bytes -> tier id, and
# block size -> namespace id of (model, block size, no LoRA). ``Core.apply_batches``
# keeps one per call (filled as it goes); a ``WireSink`` keeps one for its engine
# (filled by ``refresh``), and the lane applies only batches it fully covers.
ctypedef struct WireCache:
    char med[4][16]
    int med_len[4]
    int med_tier[4]
    int n_med
    int nil_tier            # the tier of a nil medium (GPU); -1 not resolved yet
    int64_t ns_bs[4]
    int ns_id[4]
    int n_ns


cdef inline void _cache_reset(WireCache* c) noexcept nogil:
    c.n_med = 0
    c.nil_tier = -1
    c.n_ns = 0


cdef inline int _cache_tier(const WireCache* c, const uint8_t* p, Py_ssize_t mpos,
                            Py_ssize_t mlen) noexcept nogil:
    """The cached tier id of a medium given as bytes (``mpos`` -1: none, GPU); -2 when
    not cached."""
    cdef int i
    if mpos < 0:
        return c.nil_tier if c.nil_tier >= 0 else -2
    for i in range(c.n_med):
        if c.med_len[i] == mlen and memcmp(c.med[i], p + mpos, mlen) == 0:
            return c.med_tier[i]
    return -2


cdef inline void _cache_put_tier(WireCache* c, const uint8_t* p, Py_ssize_t mpos,
                                 Py_ssize_t mlen, int tier) noexcept nogil:
    if tier < 0:
        return
    if mpos < 0:
        c.nil_tier = tier
    elif mlen <= 16 and c.n_med < 4:
        memcpy(c.med[c.n_med], p + mpos, mlen)
        c.med_len[c.n_med] = <int>mlen
        c.med_tier[c.n_med] = tier
        c.n_med += 1


cdef inline int _cache_ns(const WireCache* c, int64_t bs) noexcept nogil:
    """The cached namespace id of block size ``bs``; -2 when not cached."""
    cdef int i
    for i in range(c.n_ns):
        if c.ns_bs[i] == bs:
            return c.ns_id[i]
    return -2


cdef inline void _cache_put_ns(WireCache* c, int64_t bs, int ns) noexcept nogil:
    if ns < 0:
        return
    if c.n_ns == 4:  # keep the newest: a store names one block size, usually the same
        c.n_ns = 3
        c.ns_bs[0], c.ns_id[0] = c.ns_bs[3], c.ns_id[3]
    c.ns_bs[c.n_ns] = bs
    c.ns_id[c.n_ns] = ns
    c.n_ns += 1


cdef inline uint64_t _be(const uint8_t* p, int k) noexcept nogil:
    """``k`` bytes at ``p`` as a big-endian unsigned integer (msgpack's byte order)."""
    cdef uint64_t v = 0
    cdef int j
    for j in range(k):
        v = (v << 8) | p[j]
    return v


cdef inline Py_ssize_t _w_len(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, uint8_t fix_lo,
                              uint8_t fix_mask, uint8_t b16, uint8_t b32, uint8_t b8,
                              int64_t* n) noexcept nogil:
    """A container or string header: the position after it, count in ``n``; -1 when
    the byte at ``pos`` is not one (``b8`` 0 = no 8-bit length form)."""
    cdef uint8_t b
    if pos >= end:
        return -1
    b = p[pos]
    if (b & ~fix_mask) == fix_lo:
        n[0] = b & fix_mask
        return pos + 1
    if b8 and b == b8:
        if pos + 2 > end:
            return -1
        n[0] = p[pos + 1]
        return pos + 2
    if b == b16:
        if pos + 3 > end:
            return -1
        n[0] = _be(p + pos + 1, 2)
        return pos + 3
    if b == b32:
        if pos + 5 > end:
            return -1
        n[0] = _be(p + pos + 1, 4)
        return pos + 5
    return -1


cdef inline Py_ssize_t _w_array(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, int64_t* n) noexcept nogil:
    return _w_len(p, pos, end, 0x90, 0x0F, 0xDC, 0xDD, 0, n)


cdef inline Py_ssize_t _w_map(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, int64_t* n) noexcept nogil:
    return _w_len(p, pos, end, 0x80, 0x0F, 0xDE, 0xDF, 0, n)


cdef inline Py_ssize_t _w_str(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t* spos,
                              Py_ssize_t* slen) noexcept nogil:
    """An ASCII string: its bytes' position and length; -1 when not a string, truncated
    or not ASCII (UTF-8 validation is left to the general path)."""
    cdef int64_t n
    cdef Py_ssize_t q = _w_len(p, pos, end, 0xA0, 0x1F, 0xDA, 0xDB, 0xD9, &n)
    cdef Py_ssize_t i
    if q < 0 or n > end - q:
        return -1
    for i in range(q, q + n):
        if p[i] >= 0x80:
            return -1
    spos[0] = q
    slen[0] = n
    return q + n


cdef inline Py_ssize_t _w_int(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, uint64_t* v,
                              bint* neg) noexcept nogil:
    """Any msgpack int, as its 64 bits (two's complement for negatives)."""
    cdef uint8_t b
    cdef int k
    cdef uint64_t u
    if pos >= end:
        return -1
    b = p[pos]
    if b <= 0x7F:
        v[0] = b
        neg[0] = False
        return pos + 1
    if b >= 0xE0:
        v[0] = <uint64_t><int64_t><int8_t>b
        neg[0] = True
        return pos + 1
    if 0xCC <= b <= 0xCF:
        k = 1 << (b - 0xCC)
        if pos + 1 + k > end:
            return -1
        v[0] = _be(p + pos + 1, k)
        neg[0] = False
        return pos + 1 + k
    if 0xD0 <= b <= 0xD3:
        k = 1 << (b - 0xD0)
        if pos + 1 + k > end:
            return -1
        u = _be(p + pos + 1, k)
        if k < 8 and (u >> (8 * k - 1)) & 1:
            u |= ~((<uint64_t>1 << (8 * k)) - 1)  # sign-extend
        v[0] = u
        neg[0] = <int64_t>u < 0
        return pos + 1 + k
    return -1


cdef inline Py_ssize_t _w_i64(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, int64_t* v) noexcept nogil:
    """An int in the int64 range (a uint64 above it is -1)."""
    cdef uint64_t u
    cdef bint neg
    pos = _w_int(p, pos, end, &u, &neg)
    if pos < 0 or (not neg and u > <uint64_t>0x7FFFFFFFFFFFFFFF):
        return -1
    v[0] = <int64_t>u
    return pos


cdef extern from *:
    """
    #include <string.h>
    /* Big-endian loads (msgpack's byte order) in one instruction each. */
    static inline unsigned long long kv_be64(const unsigned char* p) {
        unsigned long long v; memcpy(&v, p, 8);
    #if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        v = __builtin_bswap64(v);
    #endif
        return v;
    }
    static inline unsigned int kv_be32(const unsigned char* p) {
        unsigned int v; memcpy(&v, p, 4);
    #if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        v = __builtin_bswap32(v);
    #endif
        return v;
    }
    static inline unsigned int kv_be16(const unsigned char* p) {
        return ((unsigned int)p[0] << 8) | p[1];
    }
    """
    uint64_t kv_be64(const uint8_t* p) nogil
    uint32_t kv_be32(const uint8_t* p) nogil
    uint32_t kv_be16(const uint8_t* p) nogil

cdef extern from *:
    """
    #if defined(__x86_64__) && defined(__GNUC__)
    #include <immintrin.h>
    /* Runs of msgpack uint16 ints (0xCD hi lo: every token id of a vocabulary under 65,536)
       five at a time: one 16-byte load, the five tag bytes checked at once, the ten value
       bytes shuffled into little-endian lanes and widened to 64 bits. Returns how many
       were read (a multiple of 5): it stops before the first five that are not all 0xCD,
       before `n`, or when fewer than 16 bytes remain (the load reads one past the five). */
    __attribute__((target("sse4.1")))
    static int64_t kv_u16_run_sse41(const unsigned char* p, Py_ssize_t avail, int64_t n,
                                    unsigned long long* out) {
        const __m128i tags = _mm_setr_epi8(0, 3, 6, 9, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
        const __m128i want = _mm_setr_epi8((char)0xCD, (char)0xCD, (char)0xCD, (char)0xCD, (char)0xCD,
                                           0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        const __m128i vals = _mm_setr_epi8(2, 1, 5, 4, 8, 7, 11, 10, 14, 13, -1, -1, -1, -1, -1, -1);
        int64_t i = 0;
        while (i + 5 <= n && avail >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i*)p);
            if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_shuffle_epi8(v, tags), want)) != 0xFFFF)
                break;
            __m128i w = _mm_shuffle_epi8(v, vals);
            _mm_storeu_si128((__m128i*)(out + i), _mm_cvtepu16_epi64(w));
            _mm_storeu_si128((__m128i*)(out + i + 2), _mm_cvtepu16_epi64(_mm_srli_si128(w, 4)));
            out[i + 4] = (unsigned long long)(unsigned)_mm_extract_epi16(w, 4);
            i += 5;
            p += 15;
            avail -= 15;
        }
        return i;
    }
    static int kv_has_sse41 = -1;
    static inline int64_t kv_u16_run(const unsigned char* p, Py_ssize_t avail, int64_t n,
                                     unsigned long long* out) {
        if (kv_has_sse41 < 0)
            kv_has_sse41 = __builtin_cpu_supports("sse4.1") ? 1 : 0;
        return kv_has_sse41 ? kv_u16_run_sse41(p, avail, n, out) : 0;
    }
    #else
    static inline int64_t kv_u16_run(const unsigned char* p, Py_ssize_t avail, int64_t n,
                                     unsigned long long* out) { return 0; }
    #endif
    """
    int64_t kv_u16_run(const uint8_t* p, Py_ssize_t avail, int64_t n, uint64_t* out) nogil


DEF INTS_NEG = 1        # _w_ints flags: some int is negative
DEF INTS_ABOVE_I64 = 2  # some int is a uint64 above the int64 range


cdef inline Py_ssize_t _w_ints(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, int64_t n,
                               uint64_t* out, int* flags) noexcept nogil:
    """``n`` msgpack ints from ``pos`` (an array's elements): the position after them, or
    -1 when one is not an int or the bytes end first. Each int's 64 bits (two's complement
    for negatives) go to ``out`` when it is not NULL; ``flags`` gets INTS_NEG and
    INTS_ABOVE_I64 or'ed in. Why: these arrays (token ids, block hashes) are nearly every
    byte of a batch, and each is walked at least twice (scan, then apply); one branch per
    element with a single load beats the general ``_w_int``, and a run of uint16 ints
    (token ids) read five at a time (``kv_u16_run``) beats one branch each."""
    cdef uint8_t b
    cdef uint64_t v
    cdef int64_t i = 0, run
    cdef int k, fl = 0
    cdef bint neg
    while i < n:
        if out != NULL and i + 5 <= n and pos + 16 <= end and p[pos] == 0xCD:
            # A run of uint16 ints (token ids): five at a time where the CPU can.
            run = kv_u16_run(p + pos, end - pos, n - i, out + i)
            if run:
                i += run
                pos += 3 * run
                continue
        if pos + 9 > end:  # the last few bytes: the bounds-checked reader
            pos = _w_int(p, pos, end, &v, &neg)
            if pos < 0:
                return -1
            if neg:
                fl |= INTS_NEG
            elif v > <uint64_t>0x7FFFFFFFFFFFFFFF:
                fl |= INTS_ABOVE_I64
        else:
            b = p[pos]
            if b <= 0x7F:
                v = b
                pos += 1
            elif b == 0xCD:
                v = kv_be16(p + pos + 1)
                pos += 3
            elif b == 0xCC:
                v = p[pos + 1]
                pos += 2
            elif b == 0xCE:
                v = kv_be32(p + pos + 1)
                pos += 5
            elif b == 0xCF:
                v = kv_be64(p + pos + 1)
                pos += 9
                if v > <uint64_t>0x7FFFFFFFFFFFFFFF:
                    fl |= INTS_ABOVE_I64
            elif b >= 0xE0:
                v = <uint64_t><int64_t><int8_t>b
                pos += 1
                fl |= INTS_NEG
            elif 0xD0 <= b <= 0xD3:
                k = 1 << (b - 0xD0)
                if k == 1:
                    v = <uint64_t><int64_t><int8_t>p[pos + 1]
                elif k == 2:
                    v = <uint64_t><int64_t><int16_t>kv_be16(p + pos + 1)
                elif k == 4:
                    v = <uint64_t><int64_t><int32_t>kv_be32(p + pos + 1)
                else:
                    v = kv_be64(p + pos + 1)
                if <int64_t>v < 0:
                    fl |= INTS_NEG
                pos += 1 + k
            else:
                return -1
        if out != NULL:
            out[i] = v
        i += 1
    flags[0] |= fl
    return pos


cdef Py_ssize_t _w_skip(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, int depth) noexcept nogil:
    """Past one value of a field nobody reads. Conservative: ext types, non-ASCII
    strings, non-string map keys and deep nesting are left to the general path (whose
    ``Any`` fields build Python objects from them, and may refuse some)."""
    cdef uint8_t b
    cdef int64_t n, i
    cdef int k
    cdef uint64_t u
    cdef bint neg
    cdef Py_ssize_t s, sl
    if pos >= end or depth > MAX_SKIP_DEPTH:
        return -1
    b = p[pos]
    if b <= 0x7F or b >= 0xE0 or 0xCC <= b <= 0xD3:
        return _w_int(p, pos, end, &u, &neg)
    if b == 0xC0 or b == 0xC2 or b == 0xC3:
        return pos + 1
    if b == 0xCA:
        return pos + 5 if pos + 5 <= end else -1
    if b == 0xCB:
        return pos + 9 if pos + 9 <= end else -1
    if (0xA0 <= b <= 0xBF) or 0xD9 <= b <= 0xDB:
        return _w_str(p, pos, end, &s, &sl)
    if 0xC4 <= b <= 0xC6:
        k = 1 << (b - 0xC4)
        if pos + 1 + k > end:
            return -1
        n = _be(p + pos + 1, k)
        if n > end - (pos + 1 + k):
            return -1
        return pos + 1 + k + n
    if (0x90 <= b <= 0x9F) or b == 0xDC or b == 0xDD:
        pos = _w_array(p, pos, end, &n)
        if n > end - pos:
            return -1
        for i in range(n):
            pos = _w_skip(p, pos, end, depth + 1)
            if pos < 0:
                return -1
        return pos
    if (0x80 <= b <= 0x8F) or b == 0xDE or b == 0xDF:
        pos = _w_map(p, pos, end, &n)
        if n > end - pos:
            return -1
        for i in range(n):
            pos = _w_str(p, pos, end, &s, &sl)
            if pos < 0:
                return -1
            pos = _w_skip(p, pos, end, depth + 1)
            if pos < 0:
                return -1
        return pos
    return -1  # ext types, 0xC1


cdef inline Py_ssize_t _w_nil_or_int(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, bint* present,
                                     uint64_t* v, bint* neg) noexcept nogil:
    if pos < end and p[pos] == 0xC0:
        present[0] = False
        return pos + 1
    present[0] = True
    return _w_int(p, pos, end, v, neg)


cdef inline Py_ssize_t _w_nil_or_str(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t* spos,
                                     Py_ssize_t* slen) noexcept nogil:
    if pos < end and p[pos] == 0xC0:
        spos[0] = -1
        slen[0] = 0
        return pos + 1
    return _w_str(p, pos, end, spos, slen)


cdef inline bint _w_is(const uint8_t* p, Py_ssize_t spos, Py_ssize_t slen, const char* name,
                       Py_ssize_t nlen) noexcept nogil:
    return slen == nlen and memcmp(p + spos, name, nlen) == 0


cdef inline bint _w_is_remote(const uint8_t* q) noexcept nogil:
    """The 6 bytes at ``q`` spell REMOTE in any case."""
    cdef const char* r = b"remote"
    cdef int i
    for i in range(6):
        if (q[i] | 0x20) != <uint8_t>r[i]:
            return False
    return True


# Field bits (one per field name, to require fields and refuse duplicates).
DEF K_HASHES = 1
DEF K_PARENT = 2
DEF K_TOKENS = 4
DEF K_BS = 8
DEF K_LORA_ID = 16
DEF K_MEDIUM = 32
DEF K_LORA_NAME = 64
DEF K_EXTRA = 128
DEF K_GROUP = 256
DEF K_KIND = 512
DEF K_WINDOW = 1024
DEF K_LOCALITY = 2048
DEF K_OWNERSHIP = 4096
DEF K_SESSION = 8192
DEF K_SALT = 16384
# The largest data_parallel_rank the common shape takes (a larger one, or a negative
# one, decodes on the general path).
DEF MAX_DP_RANK = 65535
# The fields each event type has (other keys are ignored, as msgspec does).
DEF F_OF_STORED = 32767
DEF F_OF_REMOVED = K_HASHES | K_MEDIUM | K_GROUP | K_LOCALITY | K_OWNERSHIP


cdef int _w_field(const uint8_t* p, Py_ssize_t spos, Py_ssize_t slen) noexcept nogil:
    """The field bit of a key, 0 for a name that is no field."""
    if _w_is(p, spos, slen, b"block_hashes", 12): return K_HASHES
    if _w_is(p, spos, slen, b"parent_block_hash", 17): return K_PARENT
    if _w_is(p, spos, slen, b"token_ids", 9): return K_TOKENS
    if _w_is(p, spos, slen, b"block_size", 10): return K_BS
    if _w_is(p, spos, slen, b"lora_id", 7): return K_LORA_ID
    if _w_is(p, spos, slen, b"medium", 6): return K_MEDIUM
    if _w_is(p, spos, slen, b"lora_name", 9): return K_LORA_NAME
    if _w_is(p, spos, slen, b"extra_keys", 10): return K_EXTRA
    if _w_is(p, spos, slen, b"group_idx", 9): return K_GROUP
    if _w_is(p, spos, slen, b"kv_cache_spec_kind", 18): return K_KIND
    if _w_is(p, spos, slen, b"kv_cache_spec_sliding_window", 28): return K_WINDOW
    if _w_is(p, spos, slen, b"locality", 8): return K_LOCALITY
    if _w_is(p, spos, slen, b"ownership", 9): return K_OWNERSHIP
    if _w_is(p, spos, slen, b"session_id", 10): return K_SESSION
    if _w_is(p, spos, slen, b"cache_salt", 10): return K_SALT
    if _w_is(p, spos, slen, b"type", 4): return -1
    return 0


cdef Py_ssize_t _w_event(const uint8_t* p, Py_ssize_t pos, Py_ssize_t end, WEvent* ev,
                         uint64_t* hout=NULL, int64_t hcap=0, int64_t* tout=NULL,
                         int64_t tcap=0) noexcept nogil:
    """One event of the common shape into ``ev``; the position after it, or -1. Its
    block hashes go to ``hout`` and its token ids to ``tout`` when they fit (``hcap`` /
    ``tcap`` elements; ``ev.h_read`` / ``ev.t_read`` say so): the walk that checks them
    reads them too, for the caller about to apply them."""
    cdef int64_t nkeys, j, n
    cdef Py_ssize_t s, sl, q
    cdef int f, seen = 0, allowed, fl
    cdef uint64_t u
    cdef bint neg, present, has_kind = False, kind_full = False, has_group = False
    cdef uint64_t group = 0
    pos = _w_map(p, pos, end, &nkeys)
    if pos < 0 or nkeys < 1:
        return -1
    pos = _w_str(p, pos, end, &s, &sl)
    if pos < 0 or not _w_is(p, s, sl, b"type", 4):
        return -1
    pos = _w_str(p, pos, end, &s, &sl)
    if pos < 0:
        return -1
    if _w_is(p, s, sl, b"BlockStored", 11):
        ev.kind, allowed = EV_STORED, F_OF_STORED
    elif _w_is(p, s, sl, b"BlockRemoved", 12):
        ev.kind, allowed = EV_REMOVED, F_OF_REMOVED
    elif _w_is(p, s, sl, b"AllBlocksCleared", 16):
        ev.kind, allowed = EV_CLEARED, 0
    else:
        return -1
    ev.n = ev.n_tok = ev.bs = 0
    ev.has_parent = ev.parent_neg = ev.h_read = ev.t_read = ev.h_neg = False
    ev.mpos = -1
    ev.mlen = 0
    for j in range(1, nkeys):
        pos = _w_str(p, pos, end, &s, &sl)
        if pos < 0:
            return -1
        f = _w_field(p, s, sl)
        if f < 0 or (f & seen):
            return -1  # a repeated key (or a second "type"): the general path decides
        f &= allowed
        seen |= f
        if f == 0:
            pos = _w_skip(p, pos, end, 0)
        elif f == K_HASHES:
            pos = _w_array(p, pos, end, &n)
            if pos < 0 or n > end - pos:
                return -1
            ev.hpos = pos
            ev.n = n
            ev.h_read = n <= hcap
            fl = 0
            pos = _w_ints(p, pos, end, n, hout if ev.h_read else NULL, &fl)
            if pos < 0:
                return -1  # bytes hashes and anything else: the general path
            ev.h_neg = (fl & INTS_NEG) != 0
        elif f == K_PARENT:
            pos = _w_nil_or_int(p, pos, end, &ev.has_parent, &ev.parent, &ev.parent_neg)
        elif f == K_TOKENS:
            pos = _w_array(p, pos, end, &n)
            if pos < 0 or n > end - pos:
                return -1
            ev.tpos = pos
            ev.n_tok = n
            ev.t_read = n <= tcap
            fl = 0
            pos = _w_ints(p, pos, end, n, <uint64_t*>tout if ev.t_read else NULL, &fl)
            if pos < 0 or (fl & INTS_ABOVE_I64):
                return -1
        elif f == K_BS:
            pos = _w_int(p, pos, end, &u, &neg)
            if pos < 0 or neg or u == 0 or u >= (<uint64_t>1 << 31):
                return -1
            ev.bs = <int64_t>u
        elif f == K_LORA_ID or f == K_LORA_NAME:
            if pos >= end or p[pos] != 0xC0:
                return -1
            pos += 1
        elif f == K_MEDIUM:
            pos = _w_nil_or_str(p, pos, end, &ev.mpos, &ev.mlen)
        elif f == K_EXTRA:
            if pos < end and p[pos] == 0xC0:
                pos += 1
            else:
                pos = _w_array(p, pos, end, &n)
                if pos < 0 or n > end - pos:
                    return -1
                while n > 0:
                    if p[pos] != 0xC0:  # a real extra key (LoRA, multimodal): general path
                        return -1
                    pos += 1
                    n -= 1
        elif f == K_GROUP:
            pos = _w_nil_or_int(p, pos, end, &has_group, &group, &neg)
        elif f == K_KIND:
            pos = _w_nil_or_str(p, pos, end, &s, &sl)
            has_kind = s >= 0
            kind_full = has_kind and _w_is(p, s, sl, b"full_attention", 14)
        elif f == K_WINDOW:
            pos = _w_nil_or_int(p, pos, end, &present, &u, &neg)
        elif f == K_SESSION:
            pos = _w_nil_or_str(p, pos, end, &s, &sl)
        elif f == K_SALT:
            if pos >= end or p[pos] != 0xC0:
                return -1  # a salted sequence (SGLang): the general path keys it
            pos += 1
        elif f == K_LOCALITY:
            # REMOTE blocks (any case) are the general path's: their tier is REMOTE.
            pos = _w_nil_or_str(p, pos, end, &s, &sl)
            if s >= 0 and sl == 6 and _w_is_remote(p + s):
                return -1
        else:  # ownership: any value
            pos = _w_skip(p, pos, end, 0)
        if pos < 0:
            return -1
    if ev.kind == EV_STORED:
        if (seen & (K_HASHES | K_PARENT | K_TOKENS | K_BS)) != (K_HASHES | K_PARENT | K_TOKENS | K_BS):
            return -1
        if ev.n_tok < ev.n * ev.bs:
            return -1  # a token-less store (legacy CPU offload): the general path
    elif ev.kind == EV_REMOVED and not (seen & K_HASHES):
        return -1
    # The rule of _full_attention: the spec kind decides when given, else group 0.
    ev.feeds = kind_full if has_kind else (not has_group or group == 0)
    return pos


cdef Py_ssize_t _w_batch(const uint8_t* p, Py_ssize_t end, double* ts, int64_t* n_items,
                         int64_t* n_events) noexcept nogil:
    """The batch header ``[ts, [`` of the common shape: the position of the first event,
    with ``ts``, the batch's item count (2 or 3) and the event count; -1 otherwise."""
    cdef uint64_t u
    cdef uint32_t u32
    cdef float f32
    cdef Py_ssize_t pos = _w_array(p, 0, end, n_items)
    if pos < 0 or n_items[0] < 2 or n_items[0] > 3 or pos >= end:
        return -1
    if p[pos] == 0xCB and pos + 9 <= end:
        u = _be(p + pos + 1, 8)
        memcpy(ts, &u, 8)
        pos += 9
    elif p[pos] == 0xCA and pos + 5 <= end:
        u32 = <uint32_t>_be(p + pos + 1, 4)
        memcpy(&f32, &u32, 4)
        ts[0] = f32
        pos += 5
    else:
        return -1
    return _w_array(p, pos, end, n_events)


# A whole batch read ahead of applying it (the lane's): its events with their hashes
# and tokens decoded, so the walk that checks the batch is also the one that reads it.
# Owned by a WireSink; buffers grow to the largest batch seen and are freed with it.
ctypedef struct Stage:
    WEvent* ev
    int64_t ev_cap
    uint64_t* h
    int64_t h_cap
    int64_t* t
    int64_t t_cap
    int64_t n_ev


cdef int _stage_grow(void** buf, int64_t* cap, int64_t need, size_t item) except -1 nogil:
    cdef int64_t c
    if need > cap[0]:
        c = max(need, 2 * cap[0], 256)
        buf[0] = _realloc(buf[0], c * item)
        cap[0] = c
    return 0


cdef void _stage_free(Stage* st) noexcept nogil:
    free(st.ev)
    free(st.h)
    free(st.t)
    st.ev = NULL
    st.h = NULL
    st.t = NULL
    st.ev_cap = st.h_cap = st.t_cap = st.n_ev = 0


cdef Py_ssize_t _w_stage(const uint8_t* p, Py_ssize_t end, double* ts, const WireCache* covered,
                         Stage* st, int64_t* rank) except -2 nogil:
    """Whether a whole payload is a batch of the common shape: its event count, or -1.
    With ``covered``, also -1 unless every tier and namespace its events need is in that
    cache (so applying it needs nothing else resolved). With ``st``, what the walk read is
    kept there (each event, its hashes and token ids) for :meth:`Core._staged_apply`.
    ``rank`` (if not NULL) gets the batch's ``data_parallel_rank`` (-1: absent or nil);
    a rank that is not a small non-negative int is not of the common shape."""
    cdef int64_t n_items, n_events, i, hused = 0, tused = 0
    cdef uint64_t u
    cdef bint neg, present
    cdef int fl = 0
    cdef WEvent one
    cdef WEvent* ev = &one
    cdef Py_ssize_t pos = _w_batch(p, end, ts, &n_items, &n_events)
    # An event of the common shape takes at least 18 bytes ({"type": "BlockStored"}): a
    # count the bytes cannot hold is refused before the stage grows for it.
    if pos < 0 or n_events > (end - pos) // 18:
        return -1
    if st != NULL:
        _stage_grow(<void**>&st.ev, &st.ev_cap, n_events, sizeof(WEvent))
    for i in range(n_events):
        if st == NULL:
            pos = _w_event(p, pos, end, ev)
        else:
            ev = &st.ev[i]
            pos = _w_event(p, pos, end, ev, st.h + hused, st.h_cap - hused, st.t + tused,
                           st.t_cap - tused)
        if pos < 0:
            return -1
        if st != NULL:
            if not ev.h_read or (ev.kind == EV_STORED and not ev.t_read):
                # Past the buffers' room: grow them and read this event's arrays again.
                _stage_grow(<void**>&st.h, &st.h_cap, hused + ev.n, sizeof(uint64_t))
                _w_ints(p, ev.hpos, end, ev.n, st.h + hused, &fl)
                if ev.kind == EV_STORED:
                    _stage_grow(<void**>&st.t, &st.t_cap, tused + ev.n_tok, sizeof(int64_t))
                    _w_ints(p, ev.tpos, end, ev.n_tok, <uint64_t*>(st.t + tused), &fl)
            ev.hoff = hused
            ev.toff = tused
            hused += ev.n
            if ev.kind == EV_STORED:
                tused += ev.n_tok
        if covered != NULL and ev.feeds and ev.kind != EV_CLEARED and ev.n > 0:
            if _cache_tier(covered, p, ev.mpos, ev.mlen) < 0:
                return -1
            if ev.kind == EV_STORED and _cache_ns(covered, ev.bs) < 0:
                return -1
    present = False
    if n_items == 3:
        pos = _w_nil_or_int(p, pos, end, &present, &u, &neg)  # data_parallel_rank
        if pos >= 0 and present and (neg or u > MAX_DP_RANK):
            return -1
    if pos != end:
        return -1
    if rank != NULL:
        rank[0] = <int64_t>u if present else -1
    if st != NULL:
        st.n_ev = n_events
    return n_events


cdef inline Py_ssize_t _w_scan(const uint8_t* p, Py_ssize_t end, double* ts,
                               int64_t* rank) noexcept nogil:
    """:func:`_w_stage` that keeps nothing and needs no tier known (it never raises)."""
    return _w_stage(p, end, ts, NULL, NULL, rank)


cdef class WireBatch:
    """A received batch of the common shape, left as its bytes for :class:`Core` to
    apply in place (what ``scan`` returns). Reads like a decoded
    :class:`~kvevents.wire.schema.KVEventBatch`: ``ts``, and ``events`` decoded on demand
    (the general decoder; only slow paths ask)."""

    cdef readonly double ts
    cdef readonly bytes payload
    cdef readonly object data_parallel_rank  # read by the scan (None: absent or nil)
    cdef object _decoded  # the general decoder's batch, made on first demand

    def __cinit__(self, double ts, bytes payload, data_parallel_rank=None):
        self.ts = ts
        self.payload = payload
        self.data_parallel_rank = data_parallel_rank

    cdef object _batch(self):
        if self._decoded is None:
            self._decoded = _GENERAL.decode(self.payload).batch
        return self._decoded

    @property
    def events(self):
        return self._batch().events

    def __repr__(self):
        return f"WireBatch(ts={self.ts!r}, {len(self.payload)} bytes)"


_GENERAL = BatchDecoder(raw_tokens=True)


def scan(payload):
    """A :class:`WireBatch` when ``payload`` (bytes) is a batch of the common shape,
    else None (decode it with ``schema.BatchDecoder``). Never raises for content."""
    if type(payload) is not bytes:
        return None
    cdef double ts
    cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(payload)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(payload)
    cdef Py_ssize_t r
    cdef int64_t rank = -1
    with nogil:
        r = _w_scan(p, n, &ts, &rank)
    if r < 0:
        return None
    return WireBatch(ts, payload, None if rank < 0 else rank)
