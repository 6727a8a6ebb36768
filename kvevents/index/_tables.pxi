# Hash tables of the compiled index core (included by _core.pyx).
#
# One open-addressing table type serves three maps:
#   content  : content key          -> slot
#   engine maps: engine hash (64 bit) -> slot, one table per engine
#   side refs: (slot, engine, tier)    -> extra references beyond the first
# Buckets are packed 12-byte (key, value) pairs; value -1 marks an empty bucket, so
# every 64-bit key (0 included) is storable. Linear probing on a mixed key, and
# backward-shift deletion, so there are no tombstones to clean up and a table never
# degrades under churn (evict / store cycles are the normal workload). Capacities are
# not powers of two: a bucket is picked by multiply-shift ("fastrange") and tables grow
# by 1.5x at a load of 0.8, so the load stays in [0.53, 0.8] instead of halving at
# each doubling; that is most of the index's memory per entry. The ceiling is 0.8, not
# higher, because a table settles wherever its engine's capacity puts it: at 0.85 an
# insert scans ~23 buckets and a delete shifts a cluster as long (vs ~13 at 0.8), which
# made applying the 64 x 50k trace (every engine table at 0.85) 13% slower.

cdef packed struct Bucket:
    uint64_t key
    int32_t val


cdef struct Table:
    Bucket* b
    uint64_t cap       # buckets
    int64_t n          # live entries
    bint premixed      # keys are already uniform (hash outputs): homes skip the mixer


cdef extern from *:
    """
    static inline unsigned long long kv_fastrange(unsigned long long h, unsigned long long n) {
        return (unsigned long long)(((unsigned __int128)h * n) >> 64);
    }
    """
    unsigned long long kv_fastrange(unsigned long long h, unsigned long long n) nogil


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    """splitmix64's finaliser: a bijection with full avalanche."""
    x ^= x >> 30
    x *= <uint64_t>0xBF58476D1CE4E5B9ULL
    x ^= x >> 27
    x *= <uint64_t>0x94D049BB133111EBULL
    x ^= x >> 31
    return x


cdef inline uint64_t unmix64(uint64_t x) noexcept nogil:
    """The inverse of :func:`mix64`."""
    x ^= (x >> 31) ^ (x >> 62)
    x *= <uint64_t>0x319642B2D24D8EC3ULL
    x ^= (x >> 27) ^ (x >> 54)
    x *= <uint64_t>0x96DE1B173F119089ULL
    x ^= (x >> 30) ^ (x >> 60)
    return x


cdef inline uint64_t table_home(const Table* t, uint64_t key) noexcept nogil:
    # A premixed table's keys are uniform already, so its homes skip the mixer (a
    # multiply chain per probe start, per moved bucket of a delete and per entry of a
    # growth): the content table's keys are mixer outputs (chain_key), and the engine
    # tables store mix64(engine hash), which their callers compute once per block. An
    # engine table's buckets are thus exactly where its raw hashes would sit in a mixing
    # table, so a saved state holds the raw hashes (unmixed on save, mixed again on
    # load). The side and token tables hold packed ids and slots, mixed here.
    return kv_fastrange(key if t.premixed else mix64(key), t.cap)


cdef inline uint64_t table_next(const Table* t, uint64_t i) noexcept nogil:
    i += 1
    return 0 if i == t.cap else i


cdef int table_init(Table* t, uint64_t cap) except -1 nogil:
    cdef uint64_t c = cap if cap > 8 else 8
    t.b = <Bucket*>malloc(c * sizeof(Bucket))
    if t.b == NULL:
        with gil:
            raise MemoryError()
    # Every byte 0xFF: each bucket's value is -1 (empty), in one pass the compiler
    # vectorizes (a store per 12-byte bucket was a sixth of the cost of growing a table).
    memset(t.b, 0xFF, c * sizeof(Bucket))
    t.cap = c
    t.n = 0
    return 0


cdef void table_free(Table* t) noexcept nogil:
    if t.b != NULL:
        free(t.b)
    t.b = NULL
    t.n = 0
    t.cap = 0


cdef inline int32_t table_get(const Table* t, uint64_t key) noexcept nogil:
    if t.b == NULL:
        return -1
    cdef uint64_t i = table_home(t, key)
    while True:
        if t.b[i].val < 0:
            return -1
        if t.b[i].key == key:
            return t.b[i].val
        i = table_next(t, i)


cdef int table_grow(Table* t) except -1 nogil:
    cdef Table nt
    nt.premixed = t.premixed
    table_init(&nt, t.cap + t.cap // 2)
    cdef uint64_t i, j
    cdef Bucket* old = t.b
    for i in range(t.cap):
        if old[i].val >= 0:
            j = table_home(&nt, old[i].key)
            while nt.b[j].val >= 0:
                j = table_next(&nt, j)
            nt.b[j] = old[i]
    nt.n = t.n
    free(old)
    t[0] = nt
    return 0


cdef int32_t table_put(Table* t, uint64_t key, int32_t val) except -2 nogil:
    """Insert or overwrite. Returns -1 when the key was new, else its previous value."""
    cdef int32_t old
    if t.b == NULL:
        table_init(t, 8)
    if (t.n + 1) * 20 > <int64_t>t.cap * 16:
        table_grow(t)
    cdef uint64_t i = table_home(t, key)
    while t.b[i].val >= 0:
        if t.b[i].key == key:
            old = t.b[i].val
            t.b[i].val = val
            return old
        i = table_next(t, i)
    t.b[i].key = key
    t.b[i].val = val
    t.n += 1
    return -1


cdef inline void table_set_at(Table* t, uint64_t key, int32_t val) noexcept nogil:
    """Overwrite the value of a key known to be present."""
    cdef uint64_t i = table_home(t, key)
    while t.b[i].key != key or t.b[i].val < 0:
        i = table_next(t, i)
    t.b[i].val = val


cdef bint table_del(Table* t, uint64_t key) noexcept nogil:
    """Remove ``key``; returns whether it was present (backward-shift deletion)."""
    if t.b == NULL:
        return False
    cdef uint64_t cap = t.cap
    cdef uint64_t i = table_home(t, key)
    cdef uint64_t j, home, dist_home, dist_hole
    while True:
        if t.b[i].val < 0:
            return False
        if t.b[i].key == key:
            break
        i = table_next(t, i)
    j = i
    while True:
        j = table_next(t, j)
        if t.b[j].val < 0:
            break
        home = table_home(t, t.b[j].key)
        # Move b[j] into the hole at i unless its home lies cyclically in (i, j]:
        # i.e. when the hole is no farther from j than b[j]'s home is. Cyclic
        # distances by a conditional add, not `%` (two 64-bit divisions per moved
        # bucket were a fifth of this function).
        dist_home = j - home if j >= home else j + cap - home
        dist_hole = j - i if j >= i else j + cap - i
        if dist_home >= dist_hole:
            t.b[i] = t.b[j]
            i = j
    t.b[i].val = -1
    t.n -= 1
    return True


cdef inline int64_t table_nbytes(const Table* t) noexcept nogil:
    return 0 if t.b == NULL else <int64_t>(t.cap * sizeof(Bucket))
