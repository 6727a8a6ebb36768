# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
# cython: initializedcheck=False, nonecheck=False
"""Compiled core of :class:`~kvevents.index.PrefixIndex`.

Everything per event, per block and per looked-up token runs here, in C: consecutive
batches are applied in one call (:meth:`Core.apply_batches`: decoded batches, or
:class:`WireBatch` bytes read in place by ``_wire.pxi`` without the GIL) and a prompt
is matched in one call (:meth:`Core.lookup`). The Python facade (``index.py``) owns the
lock, the engine names and the counters by name; it never loops over blocks.

Data model (the index is keyed by content; the whole model, lock discipline and
state format are described in ``kvevents/index/README.md``):

* a **slot** per distinct content block: its content key (a chained 64-bit hash of the
  namespace and every token up to and including the block), its parent's key, its
  depth (1 = first block of a sequence; 0 = not on a chain from a sequence start), its
  namespace and, for the blocks within a sequence's first ``HEAD_TOKENS`` tokens only,
  its tokens (what ``/v1/prefixes`` and ``/v1/blocks`` show; nothing else reads them);
* per tier, an engine bitmask per slot (``W`` 64-bit words): bit set = the (engine, tier,
  block) entry is resident. Its reference count is the bit (1) plus, only for counts
  above 1 (re-announced blocks), an entry in the side table;
* per engine, an engine-hash -> slot table that translates removals and parents (engines
  need not share a hash seed);
* the content table: content key -> slot.

A slot is freed when no engine holds it in any tier; children keep their parent's key,
not its slot number, so a reused slot is never mistaken for a live parent.

Lifecycle: one ``Core`` per index, owned and locked by the facade (not thread-safe on
its own: applying wire batches and clearing engines release the GIL and rely on the
facade's lock). Failure: an event that cannot be applied (hashes or tokens of the wrong
type or range, a namespace or tier beyond the caps) is skipped whole, before any
change, and counted by reason; the rest of its batch applies. Memory errors propagate.
"""

from libc.stdint cimport uint64_t, int64_t, uint32_t, int32_t, uint16_t, uint8_t, int8_t, int16_t
from libc.stdlib cimport malloc, calloc, realloc, free, qsort
from libc.string cimport memset, memcpy, memcmp
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsUnsignedLongLongMask
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_SIMPLE

include "_tables.pxi"

import hashlib

import msgspec

from ..wire.schema import (AllBlocksCleared, BatchDecoder, BlockRemoved, BlockStored,
                      RawTokensBlockStored)
from .results import ApplyStats

# Tokens of a sequence's first HEAD_TOKENS tokens are kept (for display); blocks larger
# than MAX_KEPT_BLOCK tokens never keep theirs.
DEF HEAD_TOKENS = 64
DEF MAX_KEPT_BLOCK = 1024
DEF MAX_TIERS = 8
DEF LOOKAHEAD = 8   # lookup and store chains: keys computed (buckets prefetched) ahead
DEF N_REASONS = 6

#: Why an event was refused (index into the refusal counters).
REASONS = ("bad_hash", "bad_tokens", "unsupported_tokens", "namespace_limit",
           "tier_limit", "bad_event")
DEF R_BAD_HASH = 0
DEF R_BAD_TOKENS = 1
DEF R_UNSUPPORTED = 2
DEF R_NS_LIMIT = 3
DEF R_TIER_LIMIT = 4
DEF R_BAD_EVENT = 5

# Media that name the same tier (SGLang's pinned host memory is the CPU tier). Names are
# compared upper-cased first (Mooncake and others send "cpu"); the rest are tiers as named
# (DISK, EXTERNAL, STORAGE...).
MEDIUM_ALIASES = {"CPU_PINNED": "CPU"}
#: The tier of blocks announced with ``locality="REMOTE"``: shared storage, not the
#: publishing engine's own memory, whatever its medium.
REMOTE_TIER = "REMOTE"


def tier_of(medium, locality=None):
    """The tier name of a ``medium`` (None = GPU), as the index counts it: upper-cased,
    aliases folded; ``locality="REMOTE"`` (any case) is the REMOTE tier."""
    if isinstance(locality, str) and locality.upper() == REMOTE_TIER:
        return REMOTE_TIER
    if medium is None:
        return "GPU"
    if isinstance(medium, str):
        up = medium.upper()
        return MEDIUM_ALIASES.get(up, up)
    return medium

# Per-engine cumulative counters (C array, NC per engine): stored events and blocks per tier,
# removed events and blocks per tier, then cleared, unknown, orphans, ignored, refused.
DEF C_ST_EV = 0
DEF C_ST_BL = MAX_TIERS
DEF C_RM_EV = 2 * MAX_TIERS
DEF C_RM_BL = 3 * MAX_TIERS
DEF C_CLEARED = 4 * MAX_TIERS
DEF C_UNKNOWN = 4 * MAX_TIERS + 1
DEF C_ORPHANS = 4 * MAX_TIERS + 2
DEF C_IGNORED = 4 * MAX_TIERS + 3
DEF C_REFUSED = 4 * MAX_TIERS + 4
DEF NC = 4 * MAX_TIERS + 4 + N_REASONS

DEF F_SIGNED = 1      # the engine sent negative int hashes: report them signed
DEF F_UNMAPPED = 2    # the engine may hold slots its hash table no longer points at

include "_wire.pxi"

cdef uint64_t _M = 0x9E3779B97F4A7C15ULL
cdef uint64_t _P1 = 0xD6E8FEB86659FD93ULL
cdef uint64_t _P2 = 0xA0761D6478BD642FULL
cdef uint64_t _EXTRA = 0xE7037ED1A0B428DBULL
cdef uint64_t _ORPHAN = 0x8EBC6AF09C88C6E3ULL
cdef uint64_t _TOKENLESS = 0x589965CC75374CC3ULL

_msgpack = msgspec.msgpack.Encoder()


def digest64(*parts) -> int:
    """A stable 64-bit digest of msgpack-encodable values (never Python's salted
    ``hash``): namespace roots and engine salts."""
    return int.from_bytes(hashlib.blake2b(_msgpack.encode(parts), digest_size=8).digest(), "little")


def ns_root_of(model, bs, lora, private=False) -> int:
    """A namespace's root key (a private one's differs; public roots predate it)."""
    if private:
        return digest64("kvevents-root", model, bs, lora, "salted")
    return digest64("kvevents-root", model, bs, lora)


cdef inline uint64_t rotl(uint64_t x, int r) noexcept nogil:
    return (x << r) | (x >> (64 - r))


cdef inline uint64_t row_hash(const int64_t* t, Py_ssize_t bs) noexcept nogil:
    """Hash of one block's tokens: two independent multiply-rotate lanes (even and odd
    positions) so the CPU overlaps them, joined and finalised."""
    cdef uint64_t a = 0x243F6A8885A308D3ULL ^ <uint64_t>bs
    cdef uint64_t b = 0x13198A2E03707344ULL
    cdef Py_ssize_t j = 0
    while j + 1 < bs:
        a = rotl((a ^ <uint64_t>t[j]) * _P1, 31)
        b = rotl((b ^ <uint64_t>t[j + 1]) * _P2, 29)
        j += 2
    if j < bs:
        a = rotl((a ^ <uint64_t>t[j]) * _P1, 31)
    return mix64(a ^ mix64(b))


cdef inline uint64_t chain_key(uint64_t prev, uint64_t row) noexcept nogil:
    """Content key of a block after the block (or namespace root) keyed ``prev``."""
    return mix64(prev * _M + row)


cdef uint64_t bytes_hash(const char* p, Py_ssize_t n) noexcept nogil:
    cdef uint64_t h = 0x452821E638D01377ULL ^ <uint64_t>n
    cdef Py_ssize_t i
    for i in range(n):
        h = (h ^ <uint8_t>p[i]) * _P1
        h ^= h >> 29
    return mix64(h)


cdef uint64_t seq_hash(object o, Py_ssize_t start, int depth) except? 0:
    """``obj_hash`` of the list ``o[start:]`` (without building it)."""
    cdef Py_ssize_t n = len(o), i
    cdef uint64_t h = 0x6C6C ^ <uint64_t>(n - start)
    for i in range(start, n):
        h = mix64(h * _M + obj_hash(o[i], depth + 1))
    return h | 1


cdef uint64_t canon_extra(object e, object lora, bint first, bint* salted) except? 0:
    """The digest of one block's extra key as the index keys it (0: none): the key less
    its leading LoRA name (the namespace already says the adapter, and SGLang sends it
    only as ``lora_name``). On a sequence's first block (``first``), a bare string left
    is vLLM's ``cache_salt`` (its keys are LoRA name, (image id, offset) pairs, the salt,
    prompt-embeds digests as bytes): ``salted`` is set."""
    cdef Py_ssize_t start = 0, i, n
    if e is None:
        return 0
    if not (isinstance(e, list) or isinstance(e, tuple)):
        return obj_hash(e, 0)
    n = len(e)
    if lora is not None and n and e[0] == lora:
        start = 1
    if start == n:
        return 0
    if first:
        for i in range(start, n):
            if isinstance(e[i], str):
                salted[0] = True
    return seq_hash(e, start, 0)


def extra_digest(keys) -> int:
    """The digest a block's extra ``keys`` (a tuple, as the index keys it: no LoRA name)
    are chained with: ``extra_digest((cache_salt,))`` is a salted first block's."""
    return obj_hash(keys, 0)


cdef uint64_t obj_hash(object o, int depth) except? 0:
    """Stable hash of an extra key (None, bool, int, float, str, bytes and lists or
    tuples of them); anything else goes through msgpack. Lists and tuples hash alike
    (msgpack decodes tuples as lists)."""
    cdef Py_ssize_t n, i
    cdef const char* p
    cdef uint64_t h
    if o is None:
        return 0x1
    if isinstance(o, bool):
        return 0x2 + (1 if o else 0)
    if isinstance(o, int):
        return mix64(PyLong_AsUnsignedLongLongMask(o) ^ 0xA5A5A5A5A5A5A5A5ULL) | 1
    if isinstance(o, str):
        p = PyUnicode_AsUTF8AndSize(o, &n)
        return bytes_hash(p, n) ^ 0x5151
    if isinstance(o, bytes):
        return bytes_hash(PyBytes_AS_STRING(o), PyBytes_GET_SIZE(o)) ^ 0x7373
    if (isinstance(o, list) or isinstance(o, tuple)) and depth < 16:
        h = 0x6C6C ^ <uint64_t>len(o)
        for item in o:
            h = mix64(h * _M + obj_hash(item, depth + 1))
        return h | 1
    return digest64("extra", o) | 1


cdef class Core:
    """Slots, residency masks, reference counts and the translation tables."""

    # -- slots (structure of arrays, ``cap`` entries each) --
    cdef uint64_t* key
    cdef uint64_t* parent
    cdef uint32_t* depth
    cdef uint16_t* nsid
    cdef uint64_t* masks[MAX_TIERS]   # per tier: cap * W words
    cdef int64_t cap, n_slots
    cdef int32_t* free_slots
    cdef int64_t n_free, free_cap
    cdef public int W
    cdef Table content, side
    cdef Table tokt                   # slot -> arena offset, for head blocks only
    # -- engines (``engine_cap`` entries each) --
    cdef Table* pmaps
    cdef uint64_t* psalt
    cdef uint8_t* pflags
    cdef int64_t* counts              # [engine * MAX_TIERS + tier]: resident entries
    cdef int64_t* tot                 # [engine * NC + C_*]: cumulative event counters
    cdef int engine_cap
    # -- kept head tokens (offsets in ``tokt``): arena[off] = length, then the tokens --
    cdef int64_t* arena
    cdef int64_t arena_len, arena_cap, arena_garbage
    cdef bint keep_tokens
    # -- namespaces --
    cdef uint64_t* ns_root
    cdef uint8_t* ns_priv             # 1: a namespace of salted sequences (never shown)
    cdef int ns_cap
    # -- scratch buffers (converted hashes / tokens of one event, lookup runs) --
    cdef uint64_t* sh
    cdef int64_t sh_cap
    cdef int64_t* stok
    cdef int64_t stok_cap
    cdef int32_t* ends               # [(1 + MAX_TIERS) * engine_cap]
    cdef object conv_list            # lookup's token list, converted up to conv_n
    cdef Py_ssize_t conv_n
    # -- per-apply counters (read back by the facade after each apply) --
    cdef int64_t c_st_ev[MAX_TIERS]
    cdef int64_t c_st_bl[MAX_TIERS]
    cdef int64_t c_rm_ev[MAX_TIERS]
    cdef int64_t c_rm_bl[MAX_TIERS]
    cdef int64_t c_refused[N_REASONS]
    cdef int64_t c_events, c_cleared, c_unknown, c_orphans, c_ignored
    # -- registries (Python objects; touched once per event at most, in C) --
    cdef public dict ns_id            # (model, block_size, lora, private) -> ns id
    cdef public list ns_info          # ns id -> (model, block_size, lora, private)
    cdef public dict tier_id          # medium name (None = GPU) -> tier id
    cdef public list tier_name
    cdef public list engine_orig      # engine id -> {h64: original hash} (bytes, big ints)
    cdef public list engine_ns        # engine id -> set of ns ids it uses
    cdef public int max_namespaces, max_namespaces_per_engine, max_tiers, max_block_sizes
    cdef public dict block_sizes      # (model, lora) -> block sizes in use (lookups try each)
    cdef public object last_refusal   # (reason, detail) of the latest refusal, for logs
    # The wire path's per-call cache (apply_batches resets it; see WireCache).
    cdef WireCache wc
    cdef int nt                       # len(tier_name), for code without the GIL

    def __cinit__(self):
        self.cap = 0
        self.n_slots = 0
        self.W = 1
        self.engine_cap = 0
        self.ns_cap = 0
        for t in range(MAX_TIERS):
            self.masks[t] = NULL

    def __init__(self, bint keep_tokens=True, int max_namespaces=4096,
                 int max_namespaces_per_engine=256, int max_tiers=MAX_TIERS,
                 int max_block_sizes=8):
        if not 1 <= max_namespaces <= 65535:
            raise ValueError("max_namespaces must be in [1, 65535]")
        self.keep_tokens = keep_tokens
        self.max_namespaces = max_namespaces
        self.max_namespaces_per_engine = max_namespaces_per_engine
        self.max_tiers = min(max(max_tiers, 1), MAX_TIERS)
        self.max_block_sizes = max(max_block_sizes, 1)
        self.block_sizes = {}
        self.ns_id = {}
        self.ns_info = []
        self.tier_id = {}
        self.tier_name = []
        self.engine_orig = []
        self.engine_ns = []
        self.last_refusal = None
        self.content.premixed = True
        table_init(&self.content, 1024)
        table_init(&self.side, 64)
        table_init(&self.tokt, 64)
        self._grow_slots(1024)
        self._grow_engines(64)
        self.free_cap = 0
        self.n_free = 0
        self.free_slots = NULL
        self.arena = NULL
        self.arena_len = self.arena_cap = self.arena_garbage = 0
        self.sh = NULL
        self.sh_cap = 0
        self.stok = NULL
        self.stok_cap = 0
        self.ns_root = NULL
        self.ns_priv = NULL
        self.tier(None)  # tier 0 is GPU (the wire's None), so lookups' first tier is stable

    def __dealloc__(self):
        free(self.key); free(self.parent); free(self.depth); free(self.nsid)
        for t in range(MAX_TIERS):
            free(self.masks[t])
        free(self.free_slots)
        table_free(&self.content)
        table_free(&self.side)
        table_free(&self.tokt)
        if self.pmaps != NULL:
            for p in range(self.engine_cap):
                table_free(&self.pmaps[p])
            free(self.pmaps)
        free(self.psalt); free(self.pflags); free(self.counts); free(self.tot); free(self.arena)
        free(self.ns_root); free(self.ns_priv); free(self.sh); free(self.stok); free(self.ends)

    # ------------------------------------------------------------------ storage

    cdef int _grow_slots(self, int64_t need) except -1 nogil:
        cdef int64_t cap = max(need, self.cap + self.cap // 8, 1024)
        self.key = <uint64_t*>_realloc(self.key, cap * sizeof(uint64_t))
        self.parent = <uint64_t*>_realloc(self.parent, cap * sizeof(uint64_t))
        self.depth = <uint32_t*>_realloc(self.depth, cap * sizeof(uint32_t))
        self.nsid = <uint16_t*>_realloc(self.nsid, cap * sizeof(uint16_t))
        cdef int t
        for t in range(self.nt):
            self.masks[t] = <uint64_t*>_realloc(self.masks[t], cap * self.W * sizeof(uint64_t))
            memset(self.masks[t] + self.cap * self.W, 0, (cap - self.cap) * self.W * sizeof(uint64_t))
        self.cap = cap
        return 0

    cdef int _grow_words(self, int words) except -1:
        """Widen every tier's masks to ``words`` words per slot (more engines)."""
        cdef int t
        cdef int64_t s
        cdef uint64_t* m
        for t in range(len(self.tier_name)):
            m = <uint64_t*>calloc(self.cap * words, sizeof(uint64_t))
            if m == NULL:
                raise MemoryError()
            for s in range(self.n_slots):
                memcpy(m + s * words, self.masks[t] + s * self.W, self.W * sizeof(uint64_t))
            free(self.masks[t])
            self.masks[t] = m
        self.W = words
        return 0

    cdef int _grow_engines(self, int need) except -1:
        cdef int cap = max(need, self.engine_cap * 2, 64)
        cdef int p
        self.pmaps = <Table*>_realloc(self.pmaps, cap * sizeof(Table))
        for p in range(self.engine_cap, cap):
            self.pmaps[p].b = NULL
            self.pmaps[p].n = 0
            self.pmaps[p].cap = 0
            # Engine tables hold mix64(engine hash) (see _tables.pxi): callers mix.
            self.pmaps[p].premixed = True
        self.psalt = <uint64_t*>_realloc(self.psalt, cap * sizeof(uint64_t))
        self.pflags = <uint8_t*>_realloc(self.pflags, cap * sizeof(uint8_t))
        memset(self.pflags + self.engine_cap, 0, (cap - self.engine_cap) * sizeof(uint8_t))
        self.tot = <int64_t*>_realloc(self.tot, cap * NC * sizeof(int64_t))
        memset(self.tot + self.engine_cap * NC, 0, (cap - self.engine_cap) * NC * sizeof(int64_t))
        self.counts = <int64_t*>_realloc(self.counts, cap * MAX_TIERS * sizeof(int64_t))
        memset(self.counts + self.engine_cap * MAX_TIERS, 0, (cap - self.engine_cap) * MAX_TIERS * sizeof(int64_t))
        free(self.ends)
        self.ends = <int32_t*>calloc((1 + MAX_TIERS) * cap, sizeof(int32_t))
        if self.ends == NULL:
            raise MemoryError()
        self.engine_cap = cap
        return 0

    cdef int32_t _alloc_slot(self, uint64_t key, uint64_t parent, uint32_t depth, uint16_t ns) except -2 nogil:
        cdef int32_t s
        if self.n_free:
            self.n_free -= 1
            s = self.free_slots[self.n_free]
        else:
            if self.n_slots >= 2147483647:
                with gil:
                    raise MemoryError("index slot space exhausted")
            if self.n_slots >= self.cap:
                self._grow_slots(self.n_slots + 1)
            s = <int32_t>self.n_slots
            self.n_slots += 1
        self.key[s] = key
        self.parent[s] = parent
        self.depth[s] = depth
        self.nsid[s] = ns
        table_put(&self.content, key, s)
        return s

    cdef int _free_slot(self, int32_t s) except -1 nogil:
        table_del(&self.content, self.key[s])
        cdef int32_t off
        if self.tokt.n:
            off = table_get(&self.tokt, <uint64_t>s)
            if off >= 0:
                self.arena_garbage += 1 + self.arena[off]
                table_del(&self.tokt, <uint64_t>s)
        if self.n_free >= self.free_cap:
            self.free_cap = max(1024, self.free_cap * 2)
            self.free_slots = <int32_t*>_realloc(self.free_slots, self.free_cap * sizeof(int32_t))
        self.free_slots[self.n_free] = s
        self.n_free += 1
        return 0

    cdef int _keep_tokens(self, int32_t s, const int64_t* toks, int64_t n) except -1 nogil:
        if self.arena_len + n + 1 > self.arena_cap:
            if self.arena_garbage > 4096 and self.arena_garbage * 2 > self.arena_len:
                self._compact_arena()
            if self.arena_len + n + 1 > self.arena_cap:
                self.arena_cap = max(self.arena_len + n + 1, self.arena_cap * 2, 4096)
                self.arena = <int64_t*>_realloc(self.arena, self.arena_cap * sizeof(int64_t))
        if self.arena_len >= 2147483647:
            return 0  # (display tokens only: beyond 2^31 arena words, keep no more)
        table_put(&self.tokt, <uint64_t>s, <int32_t>self.arena_len)
        self.arena[self.arena_len] = n
        memcpy(self.arena + self.arena_len + 1, toks, n * sizeof(int64_t))
        self.arena_len += n + 1
        return 0

    cdef int _compact_arena(self) except -1 nogil:
        cdef int64_t* fresh = <int64_t*>malloc(max(self.arena_cap, 1) * sizeof(int64_t))
        if fresh == NULL:
            with gil:
                raise MemoryError()
        cdef int64_t pos = 0, n
        cdef uint64_t i
        for i in range(self.tokt.cap):
            if self.tokt.b[i].val >= 0:
                n = self.arena[self.tokt.b[i].val] + 1
                memcpy(fresh + pos, self.arena + self.tokt.b[i].val, n * sizeof(int64_t))
                self.tokt.b[i].val = <int32_t>pos
                pos += n
        free(self.arena)
        self.arena = fresh
        self.arena_len = pos
        self.arena_garbage = 0
        return 0

    cdef int _scratch(self, int64_t nh, int64_t nt) except -1 nogil:
        if nh > self.sh_cap:
            self.sh_cap = max(nh, 2 * self.sh_cap, 256)
            self.sh = <uint64_t*>_realloc(self.sh, self.sh_cap * sizeof(uint64_t))
        if nt > self.stok_cap:
            self.stok_cap = max(nt, 2 * self.stok_cap, 4096)
            self.stok = <int64_t*>_realloc(self.stok, self.stok_cap * sizeof(int64_t))
        return 0

    # ------------------------------------------------------------------ registries

    def ensure_engine(self, int pid, salt):
        """Make room for engine id ``pid`` (with its hash salt); ids are reused after
        :meth:`clear_engine`."""
        if pid < 0 or pid > 65535:
            raise ValueError("engine id out of range")
        if pid >= self.engine_cap:
            self._grow_engines(pid + 1)
        if pid >= 64 * self.W:
            self._grow_words(pid // 64 + 1)
        while len(self.engine_orig) <= pid:
            self.engine_orig.append(None)
            self.engine_ns.append(None)
        self.engine_orig[pid] = {}
        self.engine_ns[pid] = set()
        self.psalt[pid] = <uint64_t>salt
        self.pflags[pid] = 0
        memset(self.tot + pid * NC, 0, NC * sizeof(int64_t))

    cpdef int tier(self, medium) except -2:
        """Tier id of a medium name (None = GPU; aliases folded); -1 beyond the cap."""
        cdef object t = self.tier_id.get(medium)
        if t is not None:
            return <int>t
        name = tier_of(medium)
        t = self.tier_id.get(name)
        if t is None:
            if len(self.tier_name) >= self.max_tiers or not isinstance(name, str):
                return -1
            t = len(self.tier_name)
            self.masks[<int>t] = <uint64_t*>calloc(max(self.cap, 1) * self.W, sizeof(uint64_t))
            if self.masks[<int>t] == NULL:
                raise MemoryError()
            self.tier_name.append(name)
            self.nt = len(self.tier_name)
            self.tier_id[name] = t
        self.tier_id[medium] = t
        return <int>t

    cdef int _namespace(self, int pid, object model, int64_t bs, object lora,
                        bint private=False) except -2:
        """Namespace id of (model, block size, LoRA, private) for engine ``pid``; -1 beyond
        a cap. A private namespace holds salted sequences: its own root, no kept tokens,
        never shown by inspection queries, reached only by lookups with a salt."""
        key = (model, bs, lora, private)
        cdef object nid = self.ns_id.get(key)
        cdef set used = <set>self.engine_ns[pid]
        if nid is not None and nid in used:
            return <int>nid
        if len(used) >= self.max_namespaces_per_engine:
            self.last_refusal = ("namespace_limit",
                                 f"engine uses {len(used)} namespaces (max_namespaces_per_engine)")
            return -1
        if nid is None:
            if len(self.ns_info) >= self.max_namespaces:
                self.last_refusal = ("namespace_limit",
                                     f"{len(self.ns_info)} namespaces in total (max_namespaces)")
                return -1
            ml = (model, lora, private)
            sizes = self.block_sizes.get(ml, 0)
            if bs > 0 and sizes >= self.max_block_sizes:
                # A lookup for (model, LoRA) tries each of its block sizes: keep them few.
                self.last_refusal = ("namespace_limit", f"model {model!r} already has {sizes} "
                                     "block sizes (max_block_sizes)")
                return -1
            if bs > 0:
                self.block_sizes[ml] = sizes + 1
            nid = len(self.ns_info)
            if <int>nid >= self.ns_cap:
                self.ns_cap = max(64, self.ns_cap * 2)
                self.ns_root = <uint64_t*>_realloc(self.ns_root, self.ns_cap * sizeof(uint64_t))
                self.ns_priv = <uint8_t*>_realloc(self.ns_priv, self.ns_cap)
            self.ns_root[<int>nid] = <uint64_t>ns_root_of(model, bs, lora, private)
            self.ns_priv[<int>nid] = private
            self.ns_info.append(key)
            self.ns_id[key] = nid
        used.add(nid)
        return <int>nid

    def namespace_root(self, int ns):
        return self.ns_root[ns]

    # ------------------------------------------------------------------ conversions

    cdef int _hash_one(self, object o, uint64_t* out, int pid) except -2:
        """One engine hash reduced to 64 bits into ``out``: 0 when the reduction is the
        identity (an int in [-2^63, 2^64)), 1 when the original must be kept (bytes,
        bigger ints), -1 when it is neither an int nor bytes."""
        cdef long long v
        cdef int overflow, k
        cdef const char* p
        cdef Py_ssize_t blen
        cdef uint64_t u
        if isinstance(o, int):
            v = PyLong_AsLongLongAndOverflow(o, &overflow)
            if overflow == 0:
                if v < 0:
                    self.pflags[pid] |= F_SIGNED  # SGLang's signed int64 hashes
                out[0] = <uint64_t>v
                return 0
            out[0] = PyLong_AsUnsignedLongLongMask(o)
            return 1 if (overflow < 0 or o >> 64) else 0
        if isinstance(o, bytes):
            p = PyBytes_AS_STRING(o)
            blen = PyBytes_GET_SIZE(o)
            u = 0
            # The last 8 bytes, little-endian (a digest's bits are uniform).
            for k in range(8):
                if blen - 8 + k >= 0:
                    u |= (<uint64_t><uint8_t>p[blen - 8 + k]) << (8 * k)
            out[0] = u
            return 1
        return -1

    cdef int _hashes(self, list hashes, int pid) except -2:
        """An event's engine hashes into ``self.sh``: -1 when one is not an int or
        bytes, 1 when some original must be kept (see :meth:`_keep_originals`), else 0."""
        cdef Py_ssize_t i, n = len(hashes)
        cdef int r, keep = 0
        self._scratch(n, 0)
        for i in range(n):
            r = self._hash_one(hashes[i], self.sh + i, pid)
            if r < 0:
                return -1
            keep |= r
        return keep

    cdef int _keep_originals(self, list hashes, int pid) except -1:
        """Remember the hashes whose 64-bit reduction is not the identity, so queries
        hand back what the engine sent."""
        cdef dict orig = <dict>self.engine_orig[pid]
        cdef Py_ssize_t i
        cdef uint64_t u
        for i in range(len(hashes)):
            o = hashes[i]
            if self._hash_one(o, &u, pid) == 1:
                orig[u] = o
        return 0

    cdef int _tokens(self, object toks, int64_t n) except -2:
        """The first ``n`` token ids into ``self.stok``: 0, or the refusal reason."""
        cdef Py_ssize_t i
        cdef long long v
        cdef int overflow
        self._scratch(0, n)
        if type(toks) is not list:
            return _raw_to_i64(toks, n, self.stok)
        i = _list_to_i64(<list>toks, 0, n, self.stok)
        if i < 0:
            return 0
        if isinstance((<list>toks)[i], list):
            return R_UNSUPPORTED  # bigram-keyed pages (EAGLE): pairs, not tokens
        return R_BAD_TOKENS

    # ------------------------------------------------------------------ references

    cdef inline int _add_ref(self, int32_t s, int pid, int tier) except -1 nogil:
        cdef uint64_t* m = self.masks[tier] + <int64_t>s * self.W + (pid >> 6)
        cdef uint64_t bit = (<uint64_t>1) << (pid & 63)
        cdef uint64_t sk
        cdef int32_t c
        if m[0] & bit:
            sk = (<uint64_t>s << 24) | (<uint64_t>pid << 8) | <uint64_t>tier
            c = table_get(&self.side, sk)
            table_put(&self.side, sk, 1 if c < 0 else c + 1)
        else:
            m[0] |= bit
            self.counts[pid * MAX_TIERS + tier] += 1
        return 0

    cdef inline bint _engine_holds(self, int32_t s, int pid) noexcept nogil:
        cdef int t
        cdef int64_t off = <int64_t>s * self.W + (pid >> 6)
        cdef uint64_t bit = (<uint64_t>1) << (pid & 63)
        for t in range(self.nt):
            if self.masks[t][off] & bit:
                return True
        return False

    cdef inline bint _anyone_holds(self, int32_t s) noexcept nogil:
        cdef int t, w
        cdef int64_t off = <int64_t>s * self.W
        for t in range(self.nt):
            for w in range(self.W):
                if self.masks[t][off + w]:
                    return True
        return False

    cdef int _remove_ref(self, int32_t s, int pid, int tier) except -2 nogil:
        """Drop one reference: -1 not held (unknown removal), 1 the engine still holds
        the slot in some tier, 0 it no longer does (the slot is freed when nobody does)."""
        cdef uint64_t* m = self.masks[tier] + <int64_t>s * self.W + (pid >> 6)
        cdef uint64_t bit = (<uint64_t>1) << (pid & 63)
        cdef uint64_t sk
        cdef int32_t c
        if not (m[0] & bit):
            return -1
        if self.side.n:
            sk = (<uint64_t>s << 24) | (<uint64_t>pid << 8) | <uint64_t>tier
            c = table_get(&self.side, sk)
            if c > 0:
                if c == 1:
                    table_del(&self.side, sk)
                else:
                    table_set_at(&self.side, sk, c - 1)
                return 1
        m[0] &= ~bit
        self.counts[pid * MAX_TIERS + tier] -= 1
        if self._engine_holds(s, pid):
            return 1
        if not self._anyone_holds(s):
            self._free_slot(s)
        return 0

    # ------------------------------------------------------------------ ingest

    def apply_batches(self, int pid, list batches, model):
        """Apply consecutive batches of engine ``pid`` (objects with an ``events`` list, or
        :class:`WireBatch`, read in place), each event in order, in one call. Returns their summed
        :class:`~kvevents.index.ApplyStats` and adds them to the engine's cumulative
        counters (read with :meth:`engine_counters`), even when an error escapes (after
        the batches before it, and part of its own, were applied)."""
        self._reset_batch_counters()
        _cache_reset(&self.wc)
        try:
            for b in batches:
                if type(b) is WireBatch:
                    self._apply_wire(pid, (<WireBatch>b).payload, model)
                else:
                    self._apply_events(pid, <list?>b.events, model)
        finally:
            stored, removed, refused = self._accumulate(pid)
        return ApplyStats(self.c_events, stored, removed, self.c_cleared, self.c_unknown,
                          self.c_orphans, self.c_ignored, refused)

    cdef void _reset_batch_counters(self) noexcept nogil:
        cdef int t
        for t in range(MAX_TIERS):
            self.c_st_ev[t] = self.c_st_bl[t] = self.c_rm_ev[t] = self.c_rm_bl[t] = 0
        for t in range(N_REASONS):
            self.c_refused[t] = 0
        self.c_events = self.c_cleared = self.c_unknown = self.c_orphans = self.c_ignored = 0

    cdef int _apply_events(self, int pid, list events, model) except -1:
        for ev in events:
            self.c_events += 1
            tp = type(ev)
            if tp is RawTokensBlockStored or tp is BlockStored:
                if not _full_attention(ev.kv_cache_spec_kind, ev.group_idx):
                    self.c_ignored += 1
                    continue
                self._stored(pid, ev, model)
            elif tp is BlockRemoved:
                if not _full_attention(None, ev.group_idx):
                    self.c_ignored += 1
                    continue
                self._removed(pid, ev)
            elif tp is AllBlocksCleared:
                self.clear_engine(pid)
                self.c_cleared += 1
            else:
                self._refuse(R_BAD_EVENT, f"not an event: {tp.__name__}")
        return 0

    cdef tuple _accumulate(self, int pid):
        cdef int64_t stored = 0, removed = 0, refused = 0
        self._accumulate_c(pid, &stored, &removed, &refused)
        return stored, removed, refused

    cdef void _accumulate_c(self, int pid, int64_t* stored, int64_t* removed,
                            int64_t* refused) noexcept nogil:
        """Add the call's counters to engine ``pid``'s cumulative ones; their stored,
        removed and refused totals."""
        cdef int64_t* c = self.tot + pid * NC
        cdef int t
        for t in range(MAX_TIERS):
            c[C_ST_EV + t] += self.c_st_ev[t]
            c[C_ST_BL + t] += self.c_st_bl[t]
            c[C_RM_EV + t] += self.c_rm_ev[t]
            c[C_RM_BL + t] += self.c_rm_bl[t]
            stored[0] += self.c_st_bl[t]
            removed[0] += self.c_rm_bl[t]
        c[C_CLEARED] += self.c_cleared
        c[C_UNKNOWN] += self.c_unknown
        c[C_ORPHANS] += self.c_orphans
        c[C_IGNORED] += self.c_ignored
        for t in range(N_REASONS):
            c[C_REFUSED + t] += self.c_refused[t]
            refused[0] += self.c_refused[t]

    cdef void _refuse(self, int reason, str detail):
        self.c_refused[reason] += 1
        self.last_refusal = (REASONS[reason], detail)

    def engine_counters(self, int pid):
        """Engine ``pid``'s cumulative counters since :meth:`ensure_engine` / the last
        :meth:`reset_counters`: ({(tier, kind): (events, blocks)}, cleared, unknown
        removals, orphan blocks, ignored events, {reason: events})."""
        cdef int64_t* c = self.tot + pid * NC
        applied = {}
        refused = {}
        cdef int t
        for t in range(len(self.tier_name)):
            if c[C_ST_EV + t]:
                applied[(self.tier_name[t], "BlockStored")] = (c[C_ST_EV + t], c[C_ST_BL + t])
            if c[C_RM_EV + t]:
                applied[(self.tier_name[t], "BlockRemoved")] = (c[C_RM_EV + t], c[C_RM_BL + t])
        for t in range(N_REASONS):
            if c[C_REFUSED + t]:
                refused[REASONS[t]] = c[C_REFUSED + t]
        return applied, c[C_CLEARED], c[C_UNKNOWN], c[C_ORPHANS], c[C_IGNORED], refused

    def reset_counters(self, int pid):
        memset(self.tot + pid * NC, 0, NC * sizeof(int64_t))

    cdef int _event_hashes(self, int pid, object ev, int* tier, int* keep) except -2:
        """The common start of a store or removal: its hashes into ``self.sh`` and its
        tier. Returns the block count; 0 for an empty or refused (counted) event."""
        hashes = ev.block_hashes
        if type(hashes) is not list:
            self._refuse(R_BAD_EVENT, "block_hashes is not a list")
            return 0
        cdef int64_t n = len(<list>hashes)
        if n == 0:
            return 0
        loc = ev.locality
        tier[0] = self.tier(REMOTE_TIER if isinstance(loc, str) and loc.upper() == REMOTE_TIER
                            else ev.medium)
        if tier[0] < 0:
            self._refuse(R_TIER_LIMIT, f"medium {ev.medium!r}: more than {self.max_tiers} tiers")
            return 0
        keep[0] = self._hashes(<list>hashes, pid)
        if keep[0] < 0:
            self._refuse(R_BAD_HASH, "a block hash is neither an int nor bytes")
            return 0
        return n

    cdef int _stored(self, int pid, object ev, object model) except -1:
        cdef int tier, keep
        cdef int64_t n = self._event_hashes(pid, ev, &tier, &keep)
        if n == 0:
            return 0
        hashes = ev.block_hashes
        lora = ev.lora_name
        if lora is None and ev.lora_id is not None:
            lora = f"lora_id:{ev.lora_id}"
        bs_obj = ev.block_size
        toks = ev.token_ids
        cdef int64_t bs = bs_obj if isinstance(bs_obj, int) and 0 < bs_obj < (1 << 31) else 0
        cdef Py_ssize_t n_tok = -1
        if type(toks) is list:
            n_tok = len(<list>toks)
        elif bs > 0:
            n_tok = _raw_count(toks)  # raw msgpack (the ingest decoder's token_ids)
        if bs > 0 and n_tok >= n * bs:
            applied = self._stored_chain(pid, ev, model, lora, tier, n, bs)
        else:
            applied = self._stored_tokenless(pid, model, lora, tier, n)
        if applied and keep:
            self._keep_originals(<list>hashes, pid)
        return 0

    cdef int _stored_chain(self, int pid, object ev, object model, object lora, int tier,
                           int64_t n, int64_t bs) except -1:
        """Returns 1 when applied, 0 when refused (counted)."""
        cdef int reason = self._tokens(ev.token_ids, n * bs)
        if reason:
            self._refuse(reason, "token_ids hold non-int64 values")
            return 0
        cdef uint64_t* xd = NULL
        extra = ev.extra_keys
        cdef int64_t i
        cdef int ns
        cdef bint has_extra = False
        if extra is not None:
            if type(extra) is not list:
                self._refuse(R_BAD_EVENT, "extra_keys is not a list")
                return 0
            for e in <list>extra:
                if e is not None:
                    has_extra = True
                    break
        parent = ev.parent_block_hash
        cdef uint64_t ph = 0
        if parent is not None and self._hash_one(parent, &ph, pid) < 0:
            self._refuse(R_BAD_HASH, "parent_block_hash is neither an int nor bytes")
            return 0
        # SGLang names the salt on every event of a salted sequence; vLLM puts it in the
        # first block's extra key (found by canon_extra). Either way the first block is
        # keyed with it, as vLLM keys it, and the sequence lives in a private namespace
        # (continuations inherit their parent's: see _chain).
        salt = getattr(ev, "cache_salt", None)
        if salt is not None and not isinstance(salt, str):
            self._refuse(R_BAD_EVENT, "cache_salt is not a string")
            return 0
        cdef bint salted = bool(salt)
        cdef bint first_salt = salted and parent is None
        if has_extra or first_salt:
            xd = <uint64_t*>malloc(n * sizeof(uint64_t))
            if xd == NULL:
                raise MemoryError()
        try:
            if has_extra:
                for i in range(n):
                    xd[i] = canon_extra(extra[i], lora, i == 0 and parent is None, &salted) \
                        if i < len(<list>extra) else 0
            elif xd != NULL:
                memset(xd, 0, n * sizeof(uint64_t))
            if first_salt and xd[0] == 0:
                xd[0] = obj_hash((salt,), 0)
            ns = self._namespace(pid, model, bs, lora, salted)
            if ns < 0:
                self.c_refused[R_NS_LIMIT] += 1
                return 0
            self._chain(pid, ns, tier, n, bs, parent is not None, ph, xd, self.sh, self.stok)
        finally:
            free(xd)
        return 1

    cdef int _chain(self, int pid, int ns, int tier, int64_t n, int64_t bs, bint has_parent,
                    uint64_t ph, const uint64_t* xd, const uint64_t* sh,
                    const int64_t* stok) except -1 nogil:
        """Store the chain of ``n`` blocks whose engine hashes are in ``sh`` and tokens
        in ``stok`` (``bs`` each; ``self.sh`` / ``self.stok`` but for a staged batch),
        under engine parent hash ``ph`` (when
        ``has_parent``) and per-block extra-key digests ``xd`` (NULL: none): both event
        readers end here, with everything checked."""
        cdef uint64_t k, prev, row
        cdef uint32_t d
        cdef int32_t ps, s, old
        cdef int64_t i
        cdef Table* pm = &self.pmaps[pid]
        if not has_parent:
            prev, d = self.ns_root[ns], 1
        else:
            ps = table_get(pm, mix64(ph))
            if ps >= 0:
                # A salted sequence's later blocks carry no salt (vLLM): they stay private
                # with their parent (this engine's own block, so its namespace is one the
                # engine already uses).
                if self.ns_priv[self.nsid[ps]] and not self.ns_priv[ns]:
                    ns = self.nsid[ps]
                prev = self.key[ps]
                d = self.depth[ps] + 1 if self.depth[ps] else 0
            else:
                # Unknown parent: a stable chain start no lookup can reach, so its
                # blocks' removals still translate.
                prev = mix64(mix64(ph ^ self.psalt[pid]) + self.ns_root[ns] * _ORPHAN)
                d = 0
        if d == 0:
            self.c_orphans += n
        # Keys are computed LOOKAHEAD blocks ahead (a key needs only the tokens and the
        # key before it), and the content and engine-table buckets they will probe are
        # prefetched meanwhile: the tables are far larger than the caches, and a prefill
        # event stores up to 128 blocks.
        cdef uint64_t keys[LOOKAHEAD]
        cdef uint64_t mh[LOOKAHEAD]       # the engine-table keys: mixed engine hashes
        cdef uint64_t kc = prev
        cdef int64_t computed = 0
        for i in range(n):
            while computed < n and computed < i + LOOKAHEAD:
                row = row_hash(stok + computed * bs, bs)
                if xd != NULL and xd[computed]:
                    row = mix64(row ^ (xd[computed] * _EXTRA))
                kc = chain_key(kc, row)
                keys[computed % LOOKAHEAD] = kc
                mh[computed % LOOKAHEAD] = mix64(sh[computed])
                kv_prefetch(&self.content.b[table_home(&self.content, kc)])
                if pm.b != NULL:
                    kv_prefetch(&pm.b[table_home(pm, mh[computed % LOOKAHEAD])])
                computed += 1
            k = keys[i % LOOKAHEAD]
            s = table_get(&self.content, k)
            if s < 0:
                s = self._alloc_slot(k, prev, d, <uint16_t>ns)
                if self.keep_tokens and d and not self.ns_priv[ns] and bs <= MAX_KEPT_BLOCK and (d - 1) * bs < HEAD_TOKENS:
                    self._keep_tokens(s, stok + i * bs, bs)
            self._add_ref(s, pid, tier)
            old = table_put(pm, mh[i % LOOKAHEAD], s)
            if old >= 0 and old != s:
                # The hash now names another block; the engine may still hold the old one.
                self.pflags[pid] |= F_UNMAPPED
            prev = k
            if d and d < <uint32_t>0xFFFFFFFE:
                d += 1
        self.c_st_ev[tier] += 1
        self.c_st_bl[tier] += n
        return 0

    cdef int _stored_tokenless(self, int pid, object model, object lora, int tier,
                               int64_t n) except -1:
        """A token-less event (legacy CPU offload): translate through the engine's table;
        an unseen hash gets an engine-salted key that no lookup reaches."""
        cdef int ns = -1
        cdef int64_t i
        cdef int32_t s
        cdef uint64_t k
        cdef Table* pm = &self.pmaps[pid]
        for i in range(n):
            if table_get(pm, mix64(self.sh[i])) < 0:
                ns = self._namespace(pid, model, 0, lora)
                if ns < 0:
                    self.c_refused[R_NS_LIMIT] += 1
                    return 0
                break
        for i in range(n):
            s = table_get(pm, mix64(self.sh[i]))
            if s < 0:
                self.c_orphans += 1
                k = mix64(self.sh[i] ^ mix64(self.psalt[pid] + self.ns_root[ns] * _TOKENLESS))
                s = table_get(&self.content, k)
                if s < 0:
                    s = self._alloc_slot(k, 0, 0, <uint16_t>ns)
                table_put(pm, mix64(self.sh[i]), s)
            self._add_ref(s, pid, tier)
        self.c_st_ev[tier] += 1
        self.c_st_bl[tier] += n
        return 1

    cdef int _removed(self, int pid, object ev) except -1:
        cdef int tier, keep
        cdef int64_t n = self._event_hashes(pid, ev, &tier, &keep)
        if n:
            self._unref(pid, tier, n, len(<dict>self.engine_orig[pid]) > 0, self.sh)
        return 0

    cdef int _unref(self, int pid, int tier, int64_t n, bint orig,
                    const uint64_t* sh) except -1 nogil:
        """Remove one reference of engine ``pid`` in ``tier`` from each of the ``n`` blocks
        whose engine hashes are in ``sh`` (both event readers end here). ``orig``:
        the engine has original hashes kept (bytes, big ints) to forget with the blocks."""
        cdef Table* pm = &self.pmaps[pid]
        cdef int64_t i
        cdef int32_t s
        cdef int r
        cdef uint64_t m
        for i in range(n):
            if i + LOOKAHEAD < n and pm.b != NULL:
                kv_prefetch(&pm.b[table_home(pm, mix64(sh[i + LOOKAHEAD]))])
            m = mix64(sh[i])
            s = table_get(pm, m)
            if s < 0:
                self.c_unknown += 1
                continue
            r = self._remove_ref(s, pid, tier)
            if r < 0:
                self.c_unknown += 1
            elif r == 0:
                table_del(pm, m)
                if orig:
                    with gil:
                        (<dict>self.engine_orig[pid]).pop(sh[i], None)
        self.c_rm_ev[tier] += 1
        self.c_rm_bl[tier] += n
        return 0

    cdef int _apply_wire(self, int pid, bytes payload, object model) except -1:
        """Apply a :class:`WireBatch`'s events straight from its bytes: what
        :meth:`_apply_events` does with the decoded events, through the same
        :meth:`_chain` / :meth:`_unref` (``scan`` accepted the bytes, so every event is
        of the common shape: only tier and namespace caps can refuse one). Runs without
        the GIL (the facade's lock guards the core); see :meth:`_wire_events`."""
        cdef const uint8_t* p = <const uint8_t*>PyBytes_AS_STRING(payload)
        cdef Py_ssize_t end = PyBytes_GET_SIZE(payload)
        cdef bint orig = len(<dict>self.engine_orig[pid]) > 0
        cdef int r
        with nogil:
            r = self._wire_events(pid, p, end, <void*>model, &self.wc, orig)
        if r:
            raise ValueError("a WireBatch whose bytes scan does not accept")
        return 0

    cdef int _wire_events(self, int pid, const uint8_t* p, Py_ssize_t end, void* model,
                          WireCache* wc, bint orig) except -1 nogil:
        """The events of a common-shape batch at ``p``, applied for engine ``pid`` (see
        :meth:`_wire_event` for ``model``, ``wc`` and ``orig``). Returns 1 when the bytes
        are not of the common shape after all (nothing of the failing event applied),
        else 0."""
        cdef double ts
        cdef int64_t n_items, n_events, i
        cdef WEvent ev
        cdef Py_ssize_t pos
        cdef int fl = 0
        pos = _w_batch(p, end, &ts, &n_items, &n_events)
        for i in range(n_events):
            # Hashes and tokens are read by the walk that checks them, into the scratch
            # buffers when they fit (else read here, once the buffers are grown).
            pos = _w_event(p, pos, end, &ev, self.sh, self.sh_cap, self.stok, self.stok_cap) \
                if pos >= 0 else -1
            if pos < 0:
                return 1
            if not ev.h_read or (ev.kind == EV_STORED and not ev.t_read):
                self._scratch(ev.n, ev.n_tok if ev.kind == EV_STORED else 0)
                _w_ints(p, ev.hpos, end, ev.n, self.sh, &fl)
                if ev.kind == EV_STORED:
                    _w_ints(p, ev.tpos, end, ev.n_tok, <uint64_t*>self.stok, &fl)
            self._wire_event(pid, p, &ev, self.sh, self.stok, model, wc, &orig)
        return 0

    cdef int _wire_event(self, int pid, const uint8_t* p, const WEvent* ev, const uint64_t* sh,
                         const int64_t* stok, void* model, WireCache* wc,
                         bint* orig) except -1 nogil:
        """One checked event of a wire batch at ``p`` (its hashes in ``sh``, tokens in
        ``stok``) applied for engine ``pid``: both wire readers (the Python path's
        :meth:`_wire_events`, the lane's :meth:`_staged_apply`) end here. ``model``: a
        borrowed reference to the engine's model name; ``orig``: the engine keeps original
        hashes (cleared with its blocks). Takes the GIL only to resolve a tier or
        namespace that ``wc`` does not hold yet (then remembered there), to count a
        refusal, or to empty the kept original hashes; an event whose tier and namespace
        ``wc`` covers, with ``orig`` False, never takes it."""
        cdef int tier, ns
        self.c_events += 1
        if not ev.feeds:
            self.c_ignored += 1
            return 0
        if ev.kind == EV_CLEARED:
            self._clear_engine(pid)
            if orig[0]:
                with gil:
                    (<dict>self.engine_orig[pid]).clear()
                orig[0] = False
            self.c_cleared += 1
            return 0
        if ev.n == 0:
            return 0
        tier = _cache_tier(wc, p, ev.mpos, ev.mlen)
        if tier == -2:
            with gil:
                tier = self._wire_tier(p, ev.mpos, ev.mlen)
            _cache_put_tier(wc, p, ev.mpos, ev.mlen, tier)
        if tier < 0:
            with gil:
                medium = p[ev.mpos:ev.mpos + ev.mlen].decode("ascii")
                self._refuse(R_TIER_LIMIT, f"medium {medium!r}: more than {self.max_tiers} tiers")
            return 0
        if ev.h_neg:
            self.pflags[pid] |= F_SIGNED  # SGLang's signed int64 hashes
        if ev.kind == EV_REMOVED:
            self._unref(pid, tier, ev.n, orig[0], sh)
            return 0
        if ev.has_parent and ev.parent_neg:
            self.pflags[pid] |= F_SIGNED
        ns = _cache_ns(wc, ev.bs)
        if ns == -2:
            with gil:
                ns = self._namespace(pid, <object>model, ev.bs, None)
            _cache_put_ns(wc, ev.bs, ns)
        if ns < 0:
            self.c_refused[R_NS_LIMIT] += 1
            return 0
        self._chain(pid, ns, tier, ev.n, ev.bs, ev.has_parent, ev.parent, NULL, sh, stok)
        return 0

    cdef int _staged_apply(self, int pid, const uint8_t* p, const Stage* st, WireCache* wc,
                           int64_t* out) except -1 nogil:
        """One batch the lane's :func:`_w_stage` read into ``st`` (``p``: its bytes, for
        the media), applied for engine ``pid`` without the GIL, its counters added to the
        engine's; ``out`` gets its stored blocks, removed blocks and clears added. The
        stage checked that ``wc`` covers every tier and namespace, and the caller (holding
        the facade's lock) that the engine keeps no original hashes: nothing here takes
        the GIL."""
        cdef int64_t stored = 0, removed = 0, refused = 0, i
        cdef bint orig = False
        cdef const WEvent* ev
        self._reset_batch_counters()
        try:
            for i in range(st.n_ev):
                ev = &st.ev[i]
                self._wire_event(pid, p, ev, st.h + ev.hoff, st.t + ev.toff, NULL, wc, &orig)
        finally:
            self._accumulate_c(pid, &stored, &removed, &refused)
            out[0] += stored
            out[1] += removed
            out[2] += self.c_cleared
        return 0

    cdef int _wire_tier(self, const uint8_t* p, Py_ssize_t mpos, Py_ssize_t mlen) except -2:
        """:meth:`tier` of a medium given as bytes."""
        if mpos < 0:
            return self.tier(None)
        return self.tier(p[mpos:mpos + mlen].decode("ascii"))

    cpdef int clear_engine(self, int pid) except -1:
        """Forget everything engine ``pid`` holds, in every tier (its table too). Costs
        the engine's own entries, unless it once re-pointed a hash at another block (then
        one pass over all slots finds what its table no longer names). The work runs
        without the GIL (a 20k-block engine took ~2.5 ms holding it, a stall for every
        HTTP request meanwhile); only the engine's kept original hashes are a dict."""
        with nogil:
            self._clear_engine(pid)
        (<dict>self.engine_orig[pid]).clear()
        return 0

    cdef int _clear_engine(self, int pid) except -1 nogil:
        """:meth:`clear_engine` without the ``engine_orig`` dict (the caller clears it)."""
        cdef Table* pm = &self.pmaps[pid]
        cdef int64_t i, nt = self.nt
        cdef uint64_t bit = (<uint64_t>1) << (pid & 63)
        cdef int w = pid >> 6
        cdef int32_t s
        cdef int t
        if self.pflags[pid] & F_UNMAPPED:
            for s in range(<int32_t>self.n_slots):
                self._clear_slot(s, pid, w, bit, nt)
        elif pm.b != NULL:
            # The engine's slots are scattered: while one is cleared, fetch the mask word
            # and key of the slot 2 * LOOKAHEAD buckets ahead, and the content-table
            # bucket (whose key is then in cache) of the one LOOKAHEAD ahead. The
            # engine's own table is read in order.
            for i in range(<int64_t>pm.cap):
                if i + 2 * LOOKAHEAD < <int64_t>pm.cap and pm.b[i + 2 * LOOKAHEAD].val >= 0:
                    s = pm.b[i + 2 * LOOKAHEAD].val
                    kv_prefetch(&self.masks[0][<int64_t>s * self.W + w])
                    kv_prefetch(&self.key[s])
                if i + LOOKAHEAD < <int64_t>pm.cap and pm.b[i + LOOKAHEAD].val >= 0:
                    kv_prefetch(&self.content.b[table_home(&self.content, self.key[pm.b[i + LOOKAHEAD].val])])
                if pm.b[i].val >= 0:
                    self._clear_slot(pm.b[i].val, pid, w, bit, nt)
        # Side references of this engine (only the re-announced entries live there).
        cdef uint64_t sk
        if self.side.n:
            i = 0
            while i < <int64_t>self.side.cap:
                if self.side.b[i].val >= 0 and ((self.side.b[i].key >> 8) & 0xFFFF) == <uint64_t>pid:
                    sk = self.side.b[i].key
                    table_del(&self.side, sk)
                    continue  # backward shift may have moved another entry into i
                i += 1
        for t in range(MAX_TIERS):
            self.counts[pid * MAX_TIERS + t] = 0
        table_free(pm)
        self.pflags[pid] &= ~(F_UNMAPPED | F_SIGNED)
        return 0

    cdef inline int _clear_slot(self, int32_t s, int pid, int w, uint64_t bit, int64_t nt) except -1 nogil:
        cdef int64_t off = <int64_t>s * self.W + w
        cdef bint had = False
        cdef int t
        for t in range(nt):
            if self.masks[t][off] & bit:
                self.masks[t][off] &= ~bit
                had = True
        if had and not self._anyone_holds(s):
            self._free_slot(s)
        return 0

    # ------------------------------------------------------------------ lookup

    cdef const int64_t* _token_ptr(self, object tokens, Py_ssize_t* n_out) except NULL:
        """Token ids as int64: a list (converted into scratch) or an int64 / int32 /
        uint32 buffer (int64 read in place). ValueError for anything else."""
        cdef Py_ssize_t i, n
        cdef long long v
        cdef int overflow
        cdef const int32_t[::1] i32
        cdef const uint32_t[::1] u32
        cdef const int64_t[::1] i64
        if type(tokens) is list:
            # Converted lazily, as matching reaches them (see _convert_upto): a long
            # prompt that stops matching early pays only for what was examined.
            n = len(<list>tokens)
            self._scratch(0, n + 1)
            self.conv_list = tokens
            self.conv_n = 0
            n_out[0] = n
            return self.stok
        mv = memoryview(tokens)
        if mv.ndim != 1:
            raise ValueError("token buffer must be one-dimensional")
        if mv.format in ("q", "l", "<q", "=q", "<l", "=l") and mv.itemsize == 8:
            i64 = tokens
            n = i64.shape[0]
            if n:
                n_out[0] = n
                return &i64[0]
            self._scratch(0, 1)
            n_out[0] = 0
            return self.stok
        if mv.format in ("i", "<i", "=i") and mv.itemsize == 4:
            i32 = tokens
            n = i32.shape[0]
            self._scratch(0, n + 1)
            for i in range(n):
                self.stok[i] = i32[i]
        elif mv.format in ("I", "<I", "=I") and mv.itemsize == 4:
            u32 = tokens
            n = u32.shape[0]
            self._scratch(0, n + 1)
            for i in range(n):
                self.stok[i] = u32[i]
        else:
            raise ValueError(f"token buffer of format {mv.format!r}: use int64, int32 or uint32")
        n_out[0] = n
        return self.stok

    def lookup(self, tokens, list spaces, list names, const int32_t[::1] rank, match_cls,
               uint64_t first_extra=0, dict extras=None):
        """Per engine, leading matched tokens over the namespaces ``spaces`` (a list of
        (ns id, block size), in preference order: an engine's best namespace wins, the
        first on ties). Returns ``match_cls(name, tokens, {tier: tokens}, block size)``
        per matching engine, sorted by tokens descending then ``rank`` (the engine's
        position in name order). ``first_extra``: the first block's extra-key digest
        (``extra_digest((cache_salt,))``; 0: none). ``extras``: per block size, a uint64
        array of each block's extra-key digest (0: none; images' keys, the salt's on the
        first block), used instead of ``first_extra`` for the blocks it covers. The token
        buffer must stay alive for the call."""
        cdef Py_ssize_t n_tok
        cdef const int64_t* tp = self._token_ptr(tokens, &n_tok)
        if n_tok >= (1 << 31):
            raise ValueError("more than 2^31 tokens")
        cdef int nt = len(self.tier_name)
        cdef int pc = self.engine_cap
        cdef int64_t* best = <int64_t*>calloc(pc, sizeof(int64_t))     # tokens
        cdef int32_t* best_sp = <int32_t*>malloc(pc * sizeof(int32_t))  # index in spaces
        cdef int32_t* tier_tok = <int32_t*>malloc(pc * MAX_TIERS * sizeof(int32_t))
        cdef int32_t* found = <int32_t*>malloc(pc * sizeof(int32_t))
        cdef int64_t* order = <int64_t*>malloc(pc * sizeof(int64_t))
        cdef int n_found, n_best = 0, i, j, t, pid
        cdef int64_t bs, tok
        cdef const uint64_t[::1] xv
        cdef const uint64_t* xp
        cdef int64_t nx
        if best == NULL or best_sp == NULL or tier_tok == NULL or found == NULL or order == NULL:
            free(best); free(best_sp); free(tier_tok); free(found); free(order)
            raise MemoryError()
        try:
            for j in range(len(spaces)):
                ns, bs_obj = spaces[j]
                bs = bs_obj
                if bs <= 0 or n_tok < bs:
                    continue
                xp, nx = NULL, 0
                if extras is not None:
                    xarr = extras.get(bs)
                    if xarr is not None and len(xarr):
                        xv = xarr
                        xp, nx = &xv[0], xv.shape[0]
                n_found = self._match_ns(tp, n_tok, <int>ns, bs, found, first_extra, xp, nx)
                for i in range(n_found):
                    pid = found[i]
                    tok = <int64_t>self.ends[pid] * bs
                    if best[pid] == 0:
                        order[n_best] = pid
                        n_best += 1
                    if tok > best[pid]:
                        best[pid] = tok
                        best_sp[pid] = j
                        for t in range(nt):
                            tier_tok[pid * MAX_TIERS + t] = self.ends[(1 + t) * pc + pid]
                    for t in range(1 + nt):
                        self.ends[t * pc + pid] = 0
            # Sort keys: tokens descending, then name rank, then the engine id itself (to
            # read it back): 31 + 16 + 16 bits.
            for i in range(n_best):
                pid = <int>order[i]
                order[i] = (((<int64_t>1 << 31) - best[pid]) << 32
                            | <int64_t>(rank[pid] & 0xFFFF) << 16 | pid)
            qsort(order, n_best, sizeof(int64_t), _cmp_i64)
            out = []
            for i in range(n_best):
                pid = <int>(order[i] & 0xFFFF)
                bs = spaces[best_sp[pid]][1]
                tiers = {}
                for t in range(nt):
                    if tier_tok[pid * MAX_TIERS + t]:
                        tiers[self.tier_name[t]] = tier_tok[pid * MAX_TIERS + t] * bs
                out.append(match_cls(names[pid], best[pid], tiers, bs))
            return out
        finally:
            self.conv_list = None
            free(best); free(best_sp); free(tier_tok); free(found); free(order)

    cdef int _convert_upto(self, Py_ssize_t end) except -1:
        """Convert the lookup's token list into ``stok`` up to ``end`` (in pieces of
        at least 1,024 tokens). ValueError names the first bad token."""
        cdef list lst = <list>self.conv_list
        cdef Py_ssize_t stop = min(max(end, self.conv_n + 1024), len(lst))
        cdef Py_ssize_t i = _list_to_i64(lst, self.conv_n, stop, self.stok)
        if i >= 0:
            if not isinstance(lst[i], int):
                raise ValueError(f"token_ids[{i}] is not an int")
            raise ValueError(f"token_ids[{i}] is out of the int64 range")
        self.conv_n = stop
        return 0

    cdef int _match_ns(self, const int64_t* tp, Py_ssize_t n_tok, int ns, int64_t bs,
                       int32_t* found, uint64_t first_extra=0, const uint64_t* xp=NULL,
                       int64_t nx=0) except -1:
        """Match one namespace: leaves, per matching engine, its any-tier run in
        ``ends[pid]`` and tier t's run in ``ends[(1 + t) * engine_cap + pid]`` (blocks), and
        the engines in ``found``; returns their number. The caller zeroes those ends.

        Keys are computed LOOKAHEAD blocks ahead of the probes and each probe's bucket
        is prefetched, so the table's cache misses overlap instead of queueing."""
        cdef int W = self.W
        cdef int nt = len(self.tier_name)
        cdef int64_t n_blocks = n_tok // bs
        cdef uint64_t run[1 + MAX_TIERS][64]     # running AND: any tier, then per tier
        cdef uint64_t* heap = NULL
        cdef uint64_t* runp
        if W > 64:
            heap = <uint64_t*>malloc((1 + MAX_TIERS) * W * sizeof(uint64_t))
            if heap == NULL:
                raise MemoryError()
        cdef uint64_t keys[LOOKAHEAD]
        cdef int c, w, t, n_found = 0
        cdef uint64_t anym, m, dropped, row
        cdef int64_t i, matched = 0, computed = 0
        cdef uint64_t k = self.ns_root[ns]
        cdef int32_t s
        cdef int64_t off
        cdef int32_t* ends = self.ends
        cdef int pc = self.engine_cap
        cdef bint alive
        for c in range(1 + nt):
            runp = heap + c * W if heap != NULL else &run[c][0]
            for w in range(W):
                runp[w] = ~(<uint64_t>0)
        for i in range(n_blocks):
            # Keep the key window LOOKAHEAD blocks ahead, prefetching each new bucket.
            while computed < n_blocks and computed < i + LOOKAHEAD:
                if self.conv_list is not None and self.conv_n < (computed + 1) * bs:
                    self._convert_upto((computed + 1) * bs)
                row = row_hash(tp + computed * bs, bs)
                if computed < nx and xp[computed]:
                    row = mix64(row ^ (xp[computed] * _EXTRA))
                elif computed == 0 and first_extra:
                    row = mix64(row ^ (first_extra * _EXTRA))
                k = chain_key(k, row)
                keys[computed % LOOKAHEAD] = k
                kv_prefetch(&self.content.b[table_home(&self.content, k)])
                computed += 1
            s = table_get(&self.content, keys[i % LOOKAHEAD])
            if s < 0:
                break
            off = <int64_t>s * W
            alive = False
            for w in range(W):
                anym = 0
                for t in range(nt):
                    m = self.masks[t][off + w]
                    anym |= m
                    runp = heap + (1 + t) * W if heap != NULL else &run[1 + t][0]
                    dropped = runp[w] & ~m
                    if dropped:
                        runp[w] &= m
                        if i:
                            _record(ends + (1 + t) * pc, dropped, w, <int32_t>i)
                runp = heap if heap != NULL else &run[0][0]
                dropped = runp[w] & ~anym
                if dropped:
                    runp[w] &= anym
                    if i:
                        _record(ends, dropped, w, <int32_t>i)
                        n_found = _collect(found, n_found, dropped, w)
                if runp[w]:
                    alive = True
            matched = i + 1
            if not alive:
                break
        # Engines still running at the end matched every examined block.
        if matched:
            for c in range(1 + nt):
                runp = heap + c * W if heap != NULL else &run[c][0]
                for w in range(W):
                    if runp[w]:
                        _record(ends + c * pc, runp[w], w, <int32_t>matched)
                        if c == 0:
                            n_found = _collect(found, n_found, runp[w], w)
        free(heap)
        return n_found

    # ------------------------------------------------------------------ inspection

    def engine_counts(self, int pid):
        """Resident entries of engine ``pid`` per tier id."""
        return [self.counts[pid * MAX_TIERS + t] for t in range(len(self.tier_name))]

    def total_entries(self):
        cdef int64_t tot = 0
        cdef int64_t i
        for i in range(self.engine_cap * MAX_TIERS):
            tot += self.counts[i]
        return tot

    def live_slots(self):
        return self.n_slots - self.n_free

    def slot_of_hash(self, int pid, h):
        """Slot of engine hash ``h`` (already reduced to 64 bits) for engine ``pid``."""
        if pid >= self.engine_cap:
            return -1
        return table_get(&self.pmaps[pid], mix64(<uint64_t>h))

    def refcount(self, int32_t s, int pid, int tier):
        """References of (engine, tier) to slot ``s``: 0 when not held."""
        cdef uint64_t bit = (<uint64_t>1) << (pid & 63)
        if not (self.masks[tier][<int64_t>s * self.W + (pid >> 6)] & bit):
            return 0
        cdef int32_t c = table_get(&self.side, (<uint64_t>s << 24) | (<uint64_t>pid << 8) | <uint64_t>tier)
        return 1 + (c if c > 0 else 0)

    def slot_info(self, int32_t s):
        """(key, parent key, depth, ns id, kept tokens or None) of slot ``s``."""
        toks = None
        cdef int32_t off = table_get(&self.tokt, <uint64_t>s)
        if off >= 0:
            toks = [self.arena[off + 1 + j] for j in range(self.arena[off])]
        return (self.key[s], self.parent[s], self.depth[s], self.nsid[s], toks)

    def slot_alive(self, int32_t s, uint64_t key):
        return s < self.n_slots and table_get(&self.content, key) == s

    def slot_of_key(self, uint64_t key):
        return table_get(&self.content, key)

    def engine_entries(self, int pid, int64_t start, int64_t limit):
        """A chunk of engine ``pid``'s table from bucket ``start``: (next start or -1,
        [(hash64, slot, tier bitmask of the engine's residency)])."""
        out = []
        if pid >= self.engine_cap or self.pmaps[pid].b == NULL:
            return -1, out
        cdef Table* pm = &self.pmaps[pid]
        cdef int64_t i = start, end = min(start + limit, <int64_t>pm.cap)
        cdef int t, tm
        cdef int32_t s
        cdef uint64_t bit = (<uint64_t>1) << (pid & 63)
        while i < end:
            s = pm.b[i].val
            if s >= 0:
                tm = 0
                for t in range(len(self.tier_name)):
                    if self.masks[t][<int64_t>s * self.W + (pid >> 6)] & bit:
                        tm |= 1 << t
                if tm:
                    out.append((unmix64(pm.b[i].key), s, tm))
            i += 1
        return (i if i < <int64_t>pm.cap else -1), out

    def engine_signed(self, int pid):
        return bool(self.pflags[pid] & F_SIGNED)

    def scan_prefixes(self, int64_t start, int64_t limit, ns_filter, uint8_t[::1] dominated,
                      bint mark):
        """One chunk of the top-prefix scan over slots [start, start + limit).

        ``mark``: first pass, set ``dominated[parent slot]`` where a child is held by
        as many engines as its parent (the parent is then never the longest extent of its
        holder set). Otherwise: return [(score, slot, key)] of live, on-chain,
        undominated slots (score = engines << 32 | depth), for the caller's top-k.
        ``ns_filter``: None or a bytes mask over namespace ids."""
        cdef int64_t s, end = min(start + limit, self.n_slots)
        cdef int t, w, nt = len(self.tier_name), W = self.W
        cdef int64_t nengines, pn
        cdef int32_t p
        cdef uint64_t m
        cdef const unsigned char* nsf = NULL
        cdef Py_ssize_t nsf_len = 0
        if ns_filter is not None:
            nsf = <const unsigned char*>PyBytes_AS_STRING(ns_filter)
            nsf_len = PyBytes_GET_SIZE(ns_filter)
        out = []
        for s in range(start, end):
            if self.depth[s] == 0:
                continue
            if nsf != NULL and (self.nsid[s] >= nsf_len or not nsf[self.nsid[s]]):
                continue
            nengines = self._nengines(<int32_t>s, nt, W)
            if nengines == 0:
                continue
            if mark:
                if self.depth[s] > 1:
                    p = table_get(&self.content, self.parent[s])
                    if p >= 0 and p < dominated.shape[0] and self._nengines(p, nt, W) == nengines:
                        dominated[p] = 1
            elif s >= dominated.shape[0] or not dominated[s]:
                out.append(((nengines << 32) | self.depth[s], s, self.key[s]))
        return out

    cdef int64_t _nengines(self, int32_t s, int nt, int W):
        cdef int64_t nengines = 0
        cdef int w, t
        cdef uint64_t m
        for w in range(W):
            m = 0
            for t in range(nt):
                m |= self.masks[t][<int64_t>s * W + w]
            nengines += _popcount(m)
        return nengines

    def holders(self, int32_t s):
        """Engine ids holding slot ``s`` in any tier."""
        cdef int t, w, b, nt = len(self.tier_name)
        cdef uint64_t m
        out = []
        for w in range(self.W):
            m = 0
            for t in range(nt):
                m |= self.masks[t][<int64_t>s * self.W + w]
            while m:
                b = _ctz(m)
                out.append(w * 64 + b)
                m &= m - 1
        return out

    @property
    def n_slot_hw(self):
        return self.n_slots

    def nbytes(self):
        """Bytes of every C allocation the core holds."""
        cdef int64_t tot = self.cap * (8 + 8 + 4 + 2)
        tot += len(self.tier_name) * self.cap * self.W * 8
        tot += table_nbytes(&self.content) + table_nbytes(&self.side) + table_nbytes(&self.tokt)
        tot += self.free_cap * 4 + self.arena_cap * 8 + self.sh_cap * 8 + self.stok_cap * 8
        tot += self.engine_cap * (sizeof(Table) + 8 + 1 + MAX_TIERS * 8 + (1 + MAX_TIERS) * 4)
        cdef int p
        for p in range(self.engine_cap):
            tot += table_nbytes(&self.pmaps[p])
        return tot

    # ------------------------------------------------------------------ state

    def export_state(self):
        """Everything as a dict of bytes and plain values (see ``state.py``)."""
        cdef int p
        cdef int64_t n = self.n_slots
        pmaps = []
        for p in range(self.engine_cap):
            if self.pmaps[p].b != NULL and self.pmaps[p].n:
                pmaps.append((p, _engine_table_bytes(&self.pmaps[p])))
        free_list = (<char*>self.free_slots)[:self.n_free * 4] if self.n_free else b""
        return {
            "n_slots": n, "W": self.W,
            "key": (<char*>self.key)[:n * 8], "parent": (<char*>self.parent)[:n * 8],
            "depth": (<char*>self.depth)[:n * 4], "nsid": (<char*>self.nsid)[:n * 2],
            "tokt": (<char*>self.tokt.b)[:self.tokt.cap * sizeof(Bucket)],
            "masks": [(<char*>self.masks[t])[:n * self.W * 8] for t in range(len(self.tier_name))],
            "free": free_list,
            "arena": (<char*>self.arena)[:self.arena_len * 8] if self.arena_len else b"",
            "side": (<char*>self.side.b)[:self.side.cap * sizeof(Bucket)],
            "pmaps": pmaps,
            "psalt": [self.psalt[p] for p in range(self.engine_cap)],
            "pflags": bytes([self.pflags[p] for p in range(self.engine_cap)]),
            "counts": (<char*>self.counts)[:self.engine_cap * MAX_TIERS * 8],
            "ns_info": [list(x) for x in self.ns_info],
            "tier_name": list(self.tier_name),
            # "pod_orig" / "pod_ns": the keys predate the engine naming; snapshots keep them.
            "pod_orig": [None if d is None else list(d.items()) for d in self.engine_orig],
            "pod_ns": [None if s is None else sorted(s) for s in self.engine_ns],
        }

    def import_state(self, dict st):
        """Load :meth:`export_state`'s dict into this (fresh) core. Raises
        ``ValueError`` when the pieces disagree with each other."""
        cdef int64_t n = st["n_slots"]
        cdef int W = st["W"]
        cdef int t, p
        tiers = st["tier_name"]
        if (n < 0 or W < 1 or len(st["key"]) != n * 8 or len(st["parent"]) != n * 8
                or len(st["depth"]) != n * 4 or len(st["nsid"]) != n * 2
                or len(st["masks"]) != len(tiers)
                or len(tiers) > self.max_tiers or len(st["free"]) % 4
                or any(len(m) != n * W * 8 for m in st["masks"])
                or len(st["arena"]) % 8 or len(st["ns_info"]) > self.max_namespaces
                or len(st["counts"]) != len(st["psalt"]) * MAX_TIERS * 8
                or len(st["pflags"]) != len(st["psalt"])):
            raise ValueError("index state: inconsistent sizes")
        nengines = len(st["psalt"])
        if nengines > 65536 or len(st["pod_orig"]) > nengines or len(st["pod_ns"]) > nengines:
            raise ValueError("index state: inconsistent engines")
        for name in tiers[len(self.tier_name):]:
            if self.tier(name) < 0:
                raise ValueError("index state: too many tiers")
        if list(self.tier_name) != list(tiers):
            raise ValueError("index state: tier order differs")
        if nengines > self.engine_cap:
            self._grow_engines(nengines)
        if W > self.W:
            self._grow_words(W)
        if n > self.cap:
            self._grow_slots(n)
        memcpy(self.key, <char*>st["key"], n * 8)
        memcpy(self.parent, <char*>st["parent"], n * 8)
        memcpy(self.depth, <char*>st["depth"], n * 4)
        memcpy(self.nsid, <char*>st["nsid"], n * 2)
        for t in range(len(tiers)):
            memcpy(self.masks[t], <char*>st["masks"][t], n * W * 8)
        self.n_slots = n
        self.n_free = len(st["free"]) // 4
        self.free_cap = max(self.n_free, 1024)
        self.free_slots = <int32_t*>_realloc(self.free_slots, self.free_cap * 4)
        if self.n_free:
            memcpy(self.free_slots, <char*>st["free"], self.n_free * 4)
        self.arena_len = len(st["arena"]) // 8
        self.arena_cap = max(self.arena_len, 4096)
        self.arena = <int64_t*>_realloc(self.arena, self.arena_cap * 8)
        if self.arena_len:
            memcpy(self.arena, <char*>st["arena"], self.arena_len * 8)
        self.arena_garbage = 0
        _load_table(&self.side, st["side"])
        _load_table(&self.tokt, st["tokt"])
        for p, raw in st["pmaps"]:
            if not 0 <= p < nengines or p >= 64 * self.W:
                raise ValueError("index state: engine table of an unknown engine")
            _load_table(&self.pmaps[p], raw)
            _engine_table_mix_keys(&self.pmaps[p])
        for p in range(nengines):
            self.psalt[p] = <uint64_t>st["psalt"][p]
            self.pflags[p] = st["pflags"][p]
        memcpy(self.counts, <char*>st["counts"], nengines * MAX_TIERS * 8)
        # States written before private namespaces have (model, bs, lora): public.
        self.ns_info = [tuple(x) if len(x) == 4 else (*x, False) for x in st["ns_info"]]
        self.ns_id = {x: i for i, x in enumerate(self.ns_info)}
        self.block_sizes = {}
        for model, bs, lora, private in self.ns_info:
            if bs > 0:
                ml = (model, lora, private)
                self.block_sizes[ml] = self.block_sizes.get(ml, 0) + 1
        self.ns_cap = max(64, len(self.ns_info))
        self.ns_root = <uint64_t*>_realloc(self.ns_root, self.ns_cap * 8)
        self.ns_priv = <uint8_t*>_realloc(self.ns_priv, self.ns_cap)
        for i, (model, bs, lora, private) in enumerate(self.ns_info):
            self.ns_root[i] = <uint64_t>ns_root_of(model, bs, lora, private)
            self.ns_priv[i] = bool(private)
        self.engine_orig = [None if d is None else dict(d) for d in st["pod_orig"]]
        self.engine_ns = [None if u is None else set(u) for u in st["pod_ns"]]
        while len(self.engine_orig) < nengines:
            self.engine_orig.append(None)
            self.engine_ns.append(None)
        # The content table is derived: rebuild it from the live slots, checking them.
        table_free(&self.content)
        table_init(&self.content, max(1024, 2 * n))
        cdef int64_t s
        cdef uint8_t* isfree = <uint8_t*>calloc(max(n, 1), 1)
        if isfree == NULL:
            raise MemoryError()
        try:
            for s in range(self.n_free):
                if not 0 <= self.free_slots[s] < n:
                    raise ValueError("index state: free slot out of range")
                isfree[self.free_slots[s]] = 1
            for s in range(n):
                if isfree[s]:
                    continue
                if self.nsid[s] >= len(self.ns_info):
                    raise ValueError("index state: slot fields out of range")
                if not table_put(&self.content, self.key[s], <int32_t>s):
                    raise ValueError("index state: duplicate content key")
        finally:
            free(isfree)
        self._check_tables(n)

    cdef int _check_tables(self, int64_t n) except -1:
        cdef int p
        cdef uint64_t i
        cdef int64_t off
        for i in range(self.tokt.cap):
            if self.tokt.b[i].val >= 0:
                off = self.tokt.b[i].val
                if (self.tokt.b[i].key >= <uint64_t>n or off >= self.arena_len
                        or self.arena[off] < 0 or off + 1 + self.arena[off] > self.arena_len):
                    raise ValueError("index state: kept tokens out of range")
        for p in range(self.engine_cap):
            if self.pmaps[p].b != NULL:
                for i in range(self.pmaps[p].cap):
                    if self.pmaps[p].b[i].val >= n:
                        raise ValueError("index state: engine table points past the slots")
        return 0


cdef int _load_table(Table* t, bytes raw) except -1:
    cdef Py_ssize_t nb = len(raw) // sizeof(Bucket)
    if len(raw) % sizeof(Bucket) or nb < 8:
        raise ValueError("index state: malformed table")
    table_free(t)
    t.b = <Bucket*>malloc(len(raw))
    if t.b == NULL:
        raise MemoryError()
    memcpy(t.b, <char*>raw, len(raw))
    t.cap = nb
    t.n = 0
    cdef Py_ssize_t i
    for i in range(nb):
        if t.b[i].val >= 0:
            t.n += 1
    # 0.85: the ceiling before 0.8 (states saved then still load; the next insert grows).
    if t.n * 20 > nb * 17:
        raise ValueError("index state: overfull table")
    return 0


cdef bytes _engine_table_bytes(const Table* t):
    """An engine table's buckets as a state stores them: with the engine's hashes as
    sent, not the mixed keys kept in memory (the buckets are the same, see
    _tables.pxi), so states load both ways between versions."""
    cdef bytes raw = (<char*>t.b)[:t.cap * sizeof(Bucket)]
    # The slice is a new object nothing else has seen yet: unmixed in place.
    cdef Bucket* b = <Bucket*>PyBytes_AS_STRING(raw)
    cdef uint64_t i
    for i in range(t.cap):
        if b[i].val >= 0:
            b[i].key = unmix64(b[i].key)
    return raw


cdef void _engine_table_mix_keys(Table* t) noexcept nogil:
    """The inverse of :func:`_engine_table_bytes`, on an engine table just loaded."""
    cdef uint64_t i
    for i in range(t.cap):
        if t.b[i].val >= 0:
            t.b[i].key = mix64(t.b[i].key)


cdef void* _realloc(void* p, size_t n) except NULL nogil:
    cdef void* q = realloc(p, n if n else 1)
    if q == NULL:
        with gil:
            raise MemoryError()
    return q


cdef Py_ssize_t _raw_count(object raw) except -2:
    """Element count of a raw msgpack array; -1 when it is not an array."""
    cdef Py_buffer view
    cdef int64_t n = -1
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        if _w_array(<const uint8_t*>view.buf, 0, view.len, &n) < 0:
            n = -1
    finally:
        PyBuffer_Release(&view)
    return n


cdef int _raw_to_i64(object raw, Py_ssize_t n, int64_t* out) except -1:
    """The first ``n`` elements of a raw msgpack int array into ``out`` (read with the
    wire readers of ``_wire.pxi``): 0, or the refusal reason (an element that is an
    array: bigram pages; anything else that is not an int in the int64 range: bad
    tokens)."""
    cdef Py_buffer view
    cdef const uint8_t* p
    cdef Py_ssize_t pos, nxt, i
    cdef int64_t count
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    try:
        p = <const uint8_t*>view.buf
        pos = _w_array(p, 0, view.len, &count)
        if pos < 0:
            return R_BAD_TOKENS
        for i in range(n):
            nxt = _w_i64(p, pos, view.len, out + i)
            if nxt < 0:
                if _w_array(p, pos, view.len, &count) >= 0:
                    return R_UNSUPPORTED  # bigram-keyed pages (EAGLE): pairs, not tokens
                return R_BAD_TOKENS
            pos = nxt
        return 0
    finally:
        PyBuffer_Release(&view)


cdef Py_ssize_t _list_to_i64(list lst, Py_ssize_t start, Py_ssize_t end, int64_t* out) except -2:
    """``lst[start:end]`` as int64 into ``out``: -1 when all converted, else the index
    of the first item that is not an int in the int64 range. Compact ints (the usual
    token ids) take Cython's inline fast path; others go through the C API."""
    cdef Py_ssize_t i
    cdef long long v
    cdef int overflow
    for i in range(start, end):
        o = lst[i]
        if type(o) is int:
            try:
                out[i] = o  # Cython's conversion: inline for compact ints
            except OverflowError:
                return i
        elif isinstance(o, int):
            v = PyLong_AsLongLongAndOverflow(o, &overflow)
            if overflow:
                return i
            out[i] = v
        else:
            return i
    return -1


cdef inline bint _full_attention(object kind, object group) noexcept:
    """Whether an event feeds prefix matching: ``kv_cache_spec_kind`` decides when
    present, else group 0 (or no group) does."""
    if kind is not None:
        return kind == "full_attention"
    return group is None or group == 0


cdef extern from *:
    """
    #if defined(__GLIBC__)
    #include <malloc.h>
    /* Keep buffers of 256 KiB and more in their own mappings, returned to the OS when
       freed. glibc otherwise raises the threshold after the first such free, and the
       index's growing tables then leave unreturnable holes in the heap. */
    static void kv_pin_mmap_threshold(void) { mallopt(M_MMAP_THRESHOLD, 256 * 1024); }
    #else
    static void kv_pin_mmap_threshold(void) {}
    #endif
    """
    void kv_pin_mmap_threshold() nogil


kv_pin_mmap_threshold()


cdef extern from *:
    """
    static inline int kv_popcount(unsigned long long x) { return __builtin_popcountll(x); }
    static inline int kv_ctz(unsigned long long x) { return __builtin_ctzll(x); }
    static inline void kv_prefetch(const void* p) { __builtin_prefetch(p); }
    """
    int kv_popcount(unsigned long long x) nogil
    int kv_ctz(unsigned long long x) nogil
    void kv_prefetch(const void* p) nogil


cdef inline int _popcount(uint64_t x) noexcept nogil:
    return kv_popcount(x)


cdef inline int _ctz(uint64_t x) noexcept nogil:
    return kv_ctz(x)


cdef inline void _record(int32_t* ends, uint64_t bits, int w, int32_t length) noexcept:
    cdef int b
    while bits:
        b = kv_ctz(bits)
        ends[w * 64 + b] = length
        bits &= bits - 1


cdef inline int _collect(int32_t* found, int n, uint64_t bits, int w) noexcept:
    cdef int b
    while bits:
        b = kv_ctz(bits)
        found[n] = w * 64 + b
        n += 1
        bits &= bits - 1
    return n


cdef int _cmp_i64(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const int64_t*>a)[0], y = (<const int64_t*>b)[0]
    return (x > y) - (x < y)


include "_sink.pxi"
