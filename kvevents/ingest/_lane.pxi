# Included by _zmqrecv.pyx: each source's stream cursor, its continuity digests, and the
# lane: the compiled pass that receives, checks and hands over a source's in-order live
# batches without the GIL.
#
# Why: at hundreds of thousands of block events a second the ingest thread ran Python
# for every message (a bytes object per frame, seq checks, digests, decode, grouping,
# signals), and every line of it held the GIL that the event loop needs to answer
# lookups and stream proxied responses. The lane does the common case in C: the next
# expected seq of a source with no replay under way, whose payload the consumer's sink
# applies (kvevents/ingest/lane_abi.pxd). Everything else (a gap, a jump, a restart, a
# replay, a malformed frame, a payload the sink declines) stops the pass and comes back
# as that message's frames, which the subscriber's Python path (stream.py) handles: the
# one reference for the semantics, reading and writing the same cursor.
#
# Lifecycle: a Cursor per followed source, made with its SourceState and owned by the
# subscriber's loop thread (all fields are read and written there only, except that
# ``stats()`` snapshots may read them from other threads: plain loads of C fields).

from libc.string cimport memcpy
from libc.stdint cimport int64_t, uint64_t, uint8_t
from cpython.pycapsule cimport PyCapsule_GetPointer
from kvevents.ingest.lane_abi cimport LaneSink

DEF RING = 4
# Seq frames are 8-byte big-endian unsigned integers (kvevents.wire.framing).
DEF SEQ_BYTES = 8

#: The name of the PyCapsule that carries a sink's ``LaneSink*``.
LANE_SINK_CAPSULE = "kvevents.ingest.LaneSink"
cdef const char* _CAPSULE_NAME = "kvevents.ingest.LaneSink"


cdef inline uint64_t _mix(uint64_t h) noexcept nogil:
    h ^= h >> 33
    h *= 0xFF51AFD7ED558CCDULL
    h ^= h >> 33
    h *= 0xC4CEB9FE1A85EC53ULL
    h ^= h >> 33
    return h


cdef uint64_t payload_digest(const uint8_t* p, Py_ssize_t n) noexcept nogil:
    """A 64-bit digest of a payload: tells a replayed batch from another one by accident,
    not against forgery (continuity checks only). Four independent multiply-xorshift
    lanes, 32 bytes a step, folded at the end: a single lane is one long chain of
    dependent multiplies (it was ~5% of the ingest thread); four keep the multiplier busy."""
    cdef uint64_t a = 0x9E3779B97F4A7C15ULL ^ <uint64_t>n
    cdef uint64_t b = 0xC2B2AE3D27D4EB4FULL
    cdef uint64_t c = 0x165667B19E3779F9ULL
    cdef uint64_t d = 0x27D4EB2F165667C5ULL
    cdef uint64_t w0, w1, w2, w3
    cdef Py_ssize_t i = 0
    while i + 32 <= n:
        memcpy(&w0, p + i, 8)
        memcpy(&w1, p + i + 8, 8)
        memcpy(&w2, p + i + 16, 8)
        memcpy(&w3, p + i + 24, 8)
        a = (a ^ w0) * 0xBF58476D1CE4E5B9ULL
        b = (b ^ w1) * 0xBF58476D1CE4E5B9ULL
        c = (c ^ w2) * 0xBF58476D1CE4E5B9ULL
        d = (d ^ w3) * 0xBF58476D1CE4E5B9ULL
        a ^= a >> 31
        b ^= b >> 31
        c ^= c >> 31
        d ^= d >> 31
        i += 32
    # Fold the lanes in order (a lane's position matters: swapping two 8-byte words of
    # a step changes the digest), then the tail 8 bytes a step as before.
    cdef uint64_t h = _mix(a) ^ (_mix(b) * 3) ^ (_mix(c) * 5) ^ (_mix(d) * 7)
    while i + 8 <= n:
        memcpy(&w0, p + i, 8)
        h = (h ^ w0) * 0xBF58476D1CE4E5B9ULL
        h ^= h >> 31
        i += 8
    if i < n:
        w0 = 0
        memcpy(&w0, p + i, n - i)
        h = (h ^ w0 ^ (<uint64_t>(n - i) << 56)) * 0x94D049BB133111EBULL
    return _mix(h)


def digest(bytes payload) -> int:
    """:func:`payload_digest` of ``payload``."""
    return payload_digest(<const uint8_t*>PyBytes_AS_STRING(payload), PyBytes_GET_SIZE(payload))


cdef class DigestRing:
    """The last ``RING`` (seq, digest) pairs delivered from one source, oldest first, to
    tell its stream apart from a restarted process's: after a reconnect or a jump the
    subscriber replays the last seqs it applied; the same process replays identical
    payloads, a new one that already published past our last seq different ones under
    the same seqs. Written by both the lane and the Python path."""

    cdef uint64_t seqs[RING]
    cdef uint64_t sums[RING]
    cdef int start, n

    cdef inline void push(self, uint64_t seq, uint64_t digest) noexcept nogil:
        cdef int i
        if self.n < RING:
            i = (self.start + self.n) % RING
            self.n += 1
        else:
            i = self.start
            self.start = (self.start + 1) % RING
        self.seqs[i] = seq
        self.sums[i] = digest

    def add(self, uint64_t seq, bytes payload) -> None:
        self.push(seq, digest(payload))

    def clear(self) -> None:
        self.start = self.n = 0

    def oldest(self):
        """The oldest seq remembered, or None."""
        return self.seqs[self.start] if self.n else None

    def check(self, uint64_t seq, bytes payload):
        """True/False if ``seq`` is remembered and its payload matches / differs; None if
        unknown."""
        cdef int k, i
        for k in range(self.n):
            i = (self.start + k) % RING
            if self.seqs[i] == seq:
                return self.sums[i] == digest(payload)
        return None

    def __len__(self) -> int:
        return self.n


cdef class Cursor:
    """One source's stream position and delivery counters, as C fields so the lane can
    use them without the GIL; the Python path reads and writes the same values through
    the properties (None where nothing is known). See kvevents.ingest.source."""

    cdef uint64_t _expected, _live_high, _stream_high, _last_seq
    # 0: unknown (None); 1: the value above; 2 (expected only): beyond 2**64 - 1, kept
    # in _expected_big (never the next seq of a live message, so never the lane's).
    cdef int has_expected, has_live_high, has_stream_high, has_last_seq
    cdef object _expected_big
    cdef double _last_batch_ts
    cdef bint has_last_batch_ts
    cdef public bint replaying          # a replay is under way: live messages are held
    cdef public int jump_streak
    cdef public int64_t batches         # delivered, both paths
    cdef public int64_t lane_batches    # of those, delivered by the lane
    cdef readonly DigestRing digests
    # What the lane applied since the last take_report(): batches, first and last seq,
    # payload bytes, and whether the sink failed (then the pass stopped there).
    cdef int64_t rep_n, rep_bytes
    cdef uint64_t rep_first, rep_last
    cdef bint rep_failed

    def __cinit__(self):
        self.digests = DigestRing()

    @property
    def expected(self):
        if self.has_expected == 2:
            return self._expected_big
        return self._expected if self.has_expected else None

    @expected.setter
    def expected(self, value):
        if value is None:
            self.has_expected = 0
        elif value > 0xFFFFFFFFFFFFFFFF:
            self.has_expected, self._expected_big = 2, value
        else:
            self.has_expected, self._expected = 1, value

    @property
    def live_high(self):
        return self._live_high if self.has_live_high else None

    @live_high.setter
    def live_high(self, value):
        self.has_live_high = value is not None
        if value is not None:
            self._live_high = value

    @property
    def stream_high(self):
        return self._stream_high if self.has_stream_high else None

    @stream_high.setter
    def stream_high(self, value):
        self.has_stream_high = value is not None
        if value is not None:
            self._stream_high = value

    @property
    def last_seq(self):
        return self._last_seq if self.has_last_seq else None

    @last_seq.setter
    def last_seq(self, value):
        self.has_last_seq = value is not None
        if value is not None:
            self._last_seq = value

    @property
    def last_batch_ts(self):
        return self._last_batch_ts if self.has_last_batch_ts else None

    @last_batch_ts.setter
    def last_batch_ts(self, value):
        self.has_last_batch_ts = value is not None
        if value is not None:
            self._last_batch_ts = value

    def take_report(self):
        """What the lane applied since the last call, and forget it: None, or
        ``(batches, first_seq, last_seq, payload_bytes, failed)``."""
        if not self.rep_n and not self.rep_failed:
            return None
        out = (self.rep_n, self.rep_first, self.rep_last, self.rep_bytes, self.rep_failed)
        self.rep_n = self.rep_bytes = 0
        self.rep_failed = False
        return out

    @property
    def pending_report(self) -> bool:
        """The lane applied something (or failed) since the last :meth:`take_report`."""
        return self.rep_n > 0 or self.rep_failed

    @property
    def report_failed(self) -> bool:
        return self.rep_failed

    def lane_drain(self, uintptr_t handle, sink, int max_msgs, Py_ssize_t max_bytes,
                   list out):
        """Receive up to ``max_msgs`` messages (about ``max_bytes``) waiting on the live
        socket ``handle`` without waiting, like :func:`drain`, handing each in-order
        batch to ``sink`` (a capsule of a ``LaneSink``) without the GIL. Stops at the
        first message the lane does not take, which is appended to ``out`` (its frames,
        as :func:`drain` gives them) for the Python path, or when the sink failed.
        Returns how many messages were taken from the socket (the lane's plus ``out``'s).

        Raises ``OSError`` like :func:`drain` (what was taken before stays taken)."""
        if z_recv == NULL:
            raise OSError("libzmq functions not loaded; call load() first")
        cdef LaneSink* s = <LaneSink*>PyCapsule_GetPointer(sink, _CAPSULE_NAME)
        cdef void* sock = <void*>handle
        cdef zmq_msg_t parts[3]
        cdef int nparts = 0, n = 0, rc, err = 0, status, more = 0, i
        cdef Py_ssize_t taken = 0, size
        cdef const uint8_t* q
        cdef uint64_t seq
        cdef double ts
        cdef bint handover = False
        with nogil:
            while n < max_msgs and taken < max_bytes:
                nparts = 0
                more = 1
                while more and nparts < 3:
                    z_init(&parts[nparts])
                    rc = z_recv(&parts[nparts], sock, ZMQ_DONTWAIT)
                    if rc < 0:
                        err = z_errno()
                        z_close(&parts[nparts])
                        break
                    taken += <Py_ssize_t>z_size(&parts[nparts])
                    more = z_more(&parts[nparts])
                    nparts += 1
                if rc < 0:
                    if nparts:  # cannot happen (atomic delivery): hand over what came
                        handover = True
                        more = 0
                    break
                n += 1
                if (not more and nparts == 3 and z_size(&parts[1]) == SEQ_BYTES
                        and self.has_expected == 1 and not self.replaying):
                    q = <const uint8_t*>z_data(&parts[1])
                    seq = 0
                    for i in range(SEQ_BYTES):
                        seq = (seq << 8) | q[i]
                    if seq == self._expected and (not self.has_live_high or seq > self._live_high):
                        q = <const uint8_t*>z_data(&parts[2])
                        size = <Py_ssize_t>z_size(&parts[2])
                        status = s.apply(s.ctx, seq, q, size, &ts)
                        if status != 1:
                            # What stream.py's _on_live and delivery.py's _deliver do for
                            # the next seq of the stream with no replay under way.
                            self.jump_streak = 0
                            self._live_high = seq
                            self.has_live_high = 1
                            self._expected = seq + 1
                            self._stream_high = seq
                            self.has_stream_high = 1
                            self._last_seq = seq
                            self.has_last_seq = 1
                            self.batches += 1
                            self.lane_batches += 1
                            self.digests.push(seq, payload_digest(q, size))
                            if self.rep_n == 0:
                                self.rep_first = seq
                            self.rep_n += 1
                            self.rep_last = seq
                            self.rep_bytes += size
                            for i in range(nparts):
                                z_close(&parts[i])
                            if status == 0:
                                self._last_batch_ts = ts
                                self.has_last_batch_ts = 1
                                continue
                            self.rep_failed = True
                            break
                handover = True
                break
        if handover:
            self._hand_over(parts, nparts, more, sock, out)
        if err and err != EAGAIN and err != EINTR:
            raise OSError(err, "zmq_msg_recv failed")
        return n

    cdef void _hand_over(self, zmq_msg_t* parts, int nparts, int more, void* sock,
                         list out) except *:
        """The frames of the message the lane stopped at, as bytes, into ``out`` (the
        rest of a message with more than three frames is received here too)."""
        cdef zmq_msg_t extra
        cdef list frames = []
        cdef int i
        try:
            for i in range(nparts):
                frames.append(PyBytes_FromStringAndSize(<char*>z_data(&parts[i]),
                                                        <Py_ssize_t>z_size(&parts[i])))
        finally:
            for i in range(nparts):
                z_close(&parts[i])
        while more:
            z_init(&extra)
            if z_recv(&extra, sock, ZMQ_DONTWAIT) < 0:
                z_close(&extra)
                break
            try:
                frames.append(PyBytes_FromStringAndSize(<char*>z_data(&extra),
                                                        <Py_ssize_t>z_size(&extra)))
                more = z_more(&extra)
            finally:
                z_close(&extra)
        out.append(frames)
