# Included by _core.pyx (after Core): the index's end of the ingest lane.
#
# NogilLock: the facade's lock (PrefixIndex.lock), with threading.Lock's interface for
# Python, that compiled code can also take without the GIL.
#
# WireSink: one engine's handle on the index for the lane (kvevents/ingest/lane_abi.pxd):
# it applies that engine's next in-order batch from the received message, without the
# GIL, when the batch is of the common wire shape and every tier and namespace it needs
# is already known (else the batch takes the Python path, which resolves them;
# ``refresh`` then learns them). The walk that checks the batch reads it too, into the
# sink's ``Stage``, before the lock is taken; only the apply runs under the lock. It
# also keeps the engine's anchor (seq and timestamp of the last batch applied, by either
# path), written under the facade's lock so a snapshot taken under it pairs the index
# with its anchors, and what the lane applied since the last report (blocks, clears,
# the apply-lag histogram).
#
# Lifecycle: made by PrefixIndex.sink(engine, model); valid until the engine is dropped
# or the index replaced (``invalidate``, under the lock), after which it declines every
# batch and has no anchor. Written by the ingest thread; ``invalidate`` and anchor reads
# run under the lock.

from cpython.pycapsule cimport PyCapsule_New
from cpython.exc cimport PyErr_Fetch, PyErr_NormalizeException
from cpython.ref cimport PyObject, Py_XDECREF
from cpython.pythread cimport (PyThread_type_lock, PyThread_allocate_lock, PyThread_free_lock,
                               PyThread_acquire_lock, PyThread_release_lock, PY_LOCK_ACQUIRED,
                               WAIT_LOCK, NOWAIT_LOCK)
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC, CLOCK_REALTIME
from kvevents.ingest.lane_abi cimport LaneSink

cdef extern from "<sched.h>" nogil:
    int sched_yield()

cdef extern from "pythread.h" nogil:
    ctypedef long long PY_TIMEOUT_T
    int PyThread_acquire_lock_timed(PyThread_type_lock, PY_TIMEOUT_T microseconds,
                                    int intr_flag)

DEF MAX_LAG_BUCKETS = 24
# After giving the lock back, how long the lane waits for a thread blocked on it to take
# it before taking it again: an unfair lock lets the thread that just released it barge
# back in, and a lookup could wait behind a whole drain.
DEF HANDOFF_NS = 200000


cdef inline double _clock(int which) noexcept nogil:
    cdef timespec t
    clock_gettime(which, &t)
    return t.tv_sec + t.tv_nsec * 1e-9


cdef class NogilLock:
    """A non-reentrant lock like ``threading.Lock`` (``acquire(blocking, timeout)``,
    ``release``, ``locked``, a context manager) that the lane takes without the GIL.
    Python threads waiting in :meth:`acquire` are counted, and the lane hands the lock
    to them before taking it again."""

    cdef PyThread_type_lock lk
    cdef int held                      # whoever holds it set this (a hint for locked())
    cdef int waiters                   # Python threads blocked in acquire()

    def __cinit__(self):
        self.lk = PyThread_allocate_lock()
        if self.lk == NULL:
            raise MemoryError()

    def __dealloc__(self):
        if self.lk != NULL:
            PyThread_free_lock(self.lk)

    def acquire(self, bint blocking=True, double timeout=-1):
        """Like ``threading.Lock.acquire``: True once held; False when not blocking or
        timed out. Waits without the GIL."""
        cdef int r
        cdef PY_TIMEOUT_T us = -1 if timeout < 0 else <PY_TIMEOUT_T>(timeout * 1e6)
        if PyThread_acquire_lock(self.lk, NOWAIT_LOCK):
            self.held = 1
            return True
        if not blocking:
            return False
        self.waiters += 1
        with nogil:
            r = PyThread_acquire_lock_timed(self.lk, us, 0)
            if r == PY_LOCK_ACQUIRED:
                self.held = 1
        self.waiters -= 1
        return r == PY_LOCK_ACQUIRED

    def release(self):
        if not self.held:
            raise RuntimeError("release unlocked lock")
        self.held = 0
        PyThread_release_lock(self.lk)

    def locked(self) -> bool:
        return bool(self.held)

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()

    cdef inline void take(self) noexcept nogil:
        PyThread_acquire_lock(self.lk, WAIT_LOCK)
        self.held = 1

    cdef inline void give(self) noexcept nogil:
        cdef int waiting = self.waiters
        cdef double until
        self.held = 0
        PyThread_release_lock(self.lk)
        if waiting > 0:
            until = _clock(CLOCK_MONOTONIC) + HANDOFF_NS * 1e-9
            while not self.held and self.waiters >= waiting and _clock(CLOCK_MONOTONIC) < until:
                sched_yield()


cdef int _sink_apply(void* ctx, uint64_t seq, const uint8_t* p, Py_ssize_t n,
                     double* ts) noexcept nogil:
    return (<WireSink>ctx).apply_lane(seq, p, n, ts)


cdef int _lane_apply(Core core, int pid, const uint8_t* p, const Stage* st, WireCache* wc,
                     int64_t* out) except -1 nogil:
    return core._staged_apply(pid, p, st, wc, out)


cdef Py_ssize_t _lane_stage(const uint8_t* p, Py_ssize_t n, double* ts, const WireCache* wc,
                            Stage* st, int64_t* rank) except -2 nogil:
    return _w_stage(p, n, ts, wc, st, rank)


# Called through these types, _lane_apply returns -1 and _lane_stage -2 with the exception
# set instead of propagating it: a function without the GIL cannot catch, and the sink
# must keep the exception for the ingest thread to report (Cython would print it and go on).
ctypedef int (*lane_apply_raw_f)(Core, int, const uint8_t*, const Stage*, WireCache*,
                                 int64_t*) noexcept nogil
ctypedef Py_ssize_t (*lane_stage_raw_f)(const uint8_t*, Py_ssize_t, double*, const WireCache*,
                                        Stage*, int64_t*) noexcept nogil


cdef class WireSink:
    """See the top of this file."""

    cdef LaneSink c
    cdef Core core
    cdef NogilLock lock
    cdef readonly int pid               # -1 once invalid
    cdef object model
    cdef WireCache cache
    cdef bint ready                     # the engine keeps no original hashes (see refresh)
    cdef object seen                    # what the cache was built from (see refresh)
    cdef readonly object capsule
    cdef bint has_anchor
    cdef uint64_t anchor_seq
    cdef double anchor_ts
    cdef int64_t rep[3]                 # since take_report: stored, removed blocks, clears
    cdef int nb                         # lag bucket bounds, then +Inf
    cdef double bounds[MAX_LAG_BUCKETS]
    cdef int64_t lag[MAX_LAG_BUCKETS + 1]
    cdef double lag_sum
    cdef object error                   # the exception a failed batch raised
    cdef Stage stage                    # the batch being applied, read ahead of the lock
    # The data-parallel rank this engine's stream is (-1: any). A batch of another rank
    # is declined: the Python path applies it and counts the mismatch.
    cdef public int64_t dp_rank

    def __cinit__(self, Core core, NogilLock lock, int pid, model, lag_bounds=()):
        if len(lag_bounds) > MAX_LAG_BUCKETS:
            raise ValueError(f"at most {MAX_LAG_BUCKETS} lag buckets")
        self.core = core
        self.lock = lock
        self.pid = pid
        self.model = model
        self.nb = len(lag_bounds)
        for i, b in enumerate(lag_bounds):
            self.bounds[i] = b
        _cache_reset(&self.cache)
        memset(&self.stage, 0, sizeof(Stage))
        self.dp_rank = -1
        self.c.apply = _sink_apply
        self.c.ctx = <void*>self
        # The capsule points into this object: whoever holds the capsule keeps the sink.
        self.capsule = PyCapsule_New(<void*>&self.c, b"kvevents.ingest.LaneSink", NULL)
        self.refresh()

    def __dealloc__(self):
        _stage_free(&self.stage)

    def refresh(self) -> None:
        """Learn what the Python path resolved since (tiers, this engine's namespaces of
        its model) and whether the engine keeps original hashes (the lane then declines:
        removals would have to forget them). Cheap when nothing new was resolved."""
        if self.pid < 0:
            return
        core = self.core
        self.ready = len(<dict>core.engine_orig[self.pid]) == 0
        # Tiers and namespaces are only ever added (until the engine or the core goes,
        # which invalidates the sink): their counts tell whether there is more to learn.
        used = <set>core.engine_ns[self.pid]
        seen = (len(core.tier_name), len(core.tier_id), len(used))
        if seen == self.seen:
            return
        self.seen = seen
        _cache_reset(&self.cache)
        self.cache.nil_tier = core.tier_id.get(None, -1)
        cdef bytes raw
        for medium, t in core.tier_id.items():
            if isinstance(medium, str) and medium.isascii() and self.cache.n_med < 4:
                raw = medium.encode("ascii")
                if len(raw) <= 16:
                    _cache_put_tier(&self.cache, <const uint8_t*>PyBytes_AS_STRING(raw), 0,
                                    len(raw), t)
        for nid in used:
            model, bs, lora, private = core.ns_info[nid]
            if model == self.model and lora is None and not private and bs > 0 and self.cache.n_ns < 4:
                _cache_put_ns(&self.cache, bs, nid)

    cdef int apply_lane(self, uint64_t seq, const uint8_t* p, Py_ssize_t n,
                        double* ts) noexcept nogil:
        """The lane's ``apply`` (see lane_abi.pxd)."""
        cdef int status = 0
        cdef double lag
        cdef int b
        cdef Py_ssize_t r
        cdef int64_t rank = -1
        if self.pid < 0 or not self.ready:
            return 1
        # Read (and checked) before taking the lock: lookups never wait on the parse.
        r = (<lane_stage_raw_f>_lane_stage)(p, n, ts, &self.cache, &self.stage, &rank)
        if r == -2:
            with gil:
                self._keep_error()
            return 2
        if r < 0 or (self.dp_rank >= 0 and rank >= 0 and rank != self.dp_rank):
            return 1
        self.lock.take()
        if self.pid < 0:  # invalidated while we waited
            self.lock.give()
            return 1
        if (<lane_apply_raw_f>_lane_apply)(self.core, self.pid, p, &self.stage, &self.cache,
                                           self.rep) < 0:
            status = 2
            with gil:
                self._keep_error()
        self.has_anchor = True
        self.anchor_seq = seq
        self.anchor_ts = ts[0]
        self.lock.give()
        lag = _clock(CLOCK_REALTIME) - ts[0]
        if not lag > 0.0:  # clock skew, or a publisher's NaN timestamp
            lag = 0.0
        b = 0
        while b < self.nb and lag > self.bounds[b]:
            b += 1
        self.lag[b] += 1
        self.lag_sum += lag
        return status

    cdef void _keep_error(self) noexcept:
        cdef PyObject* t = NULL
        cdef PyObject* v = NULL
        cdef PyObject* tb = NULL
        PyErr_Fetch(&t, &v, &tb)
        PyErr_NormalizeException(&t, &v, &tb)
        self.error = <object>v if v != NULL else RuntimeError("lane apply failed")
        Py_XDECREF(t)
        Py_XDECREF(v)
        Py_XDECREF(tb)

    def take_error(self):
        """The exception the last failed batch raised (then forgotten), or None."""
        err, self.error = self.error, None
        return err

    def take_report(self):
        """What the lane applied since the last call, and forget it: (stored blocks,
        removed blocks, clears, lag counts per bucket (the last +Inf), lag sum)."""
        out = (self.rep[0], self.rep[1], self.rep[2],
               [self.lag[i] for i in range(self.nb + 1)], self.lag_sum)
        memset(self.rep, 0, sizeof(self.rep))
        memset(self.lag, 0, sizeof(self.lag))
        self.lag_sum = 0.0
        return out

    def set_anchor(self, seq, double ts) -> None:
        """The last batch the Python path applied (the caller excludes snapshots)."""
        self.has_anchor = True
        self.anchor_seq = seq
        self.anchor_ts = ts

    @property
    def anchor(self):
        """(seq, ts) of the last batch applied, or None. Read it under the lock for a
        value that agrees with the index."""
        return (self.anchor_seq, self.anchor_ts) if self.has_anchor else None

    def invalidate(self) -> None:
        """The engine is gone from the index (call under the lock): decline everything
        from now on and forget the anchor."""
        self.pid = -1
        self.has_anchor = False

    @property
    def valid(self) -> bool:
        return self.pid >= 0
