# cython: language_level=3, boundscheck=False, wraparound=False
"""The body of an engine's chunked answer, relayed to the client's socket in compiled
code: the engine connection's protocol while the body streams.

Why: relayed in Python, every piece the engine sent cost a chain of Python calls (the
connection's ``data_received``, the parser's ``on_body``, the answer's feed, the relay's
sink framing the piece anew and keeping a tail) - about a tenth of the gateway's CPU per
streamed request, for 64 chunks. Here one compiled call per read of the engine's socket
walks the chunked framing, writes every complete chunk to the client as the engine
framed it (one ``write`` per read, no copy when the read holds whole chunks), keeps the
last ``tail_size`` bytes of the decoded body (for the usage chunk), and stops at the end
marker, which is not written as the engine sent it: the caller ends the client's answer
itself (the same ``0\\r\\n\\r\\n``, or an error event first when the engine broke off),
or has the pump write ``0\\r\\n\\r\\n`` with the last chunks at a clean end (``finish``).

The client is always left at a chunk boundary: a read that ends inside a chunk keeps
that chunk's start here until the rest arrives, unless more than ``hold_max`` bytes are
held; then they go out (``mid_chunk`` is set: an answer that breaks off now can only be
ended by closing the client's connection).

Lifecycle: made by the engine connection when a chunked answer's head is in, without a
client ("hold" mode: what would be written is kept, and reading pauses past
``hold_max``), and installed as the engine transport's protocol from the body's first
byte (:meth:`attach`). :meth:`UpstreamResponse.pump_to
<kvevents.gateway.upstream.UpstreamResponse.pump_to>` gives it the client
(:meth:`start`: what was kept goes out in one write); a reader that wants the body
decoded takes :meth:`raw` instead. The connection takes its transport back when the
answer ends. Callbacks: ``on_first()`` once, at the first body byte (TTFT; at
:meth:`start` for a body that began while held);
``on_end(error)`` once, with None at the end marker or a message when the framing is
malformed or the connection ended first (then the engine's transport is closed here or
already). Backpressure: after a write that leaves the client's socket full (the server's
flow control says ``write_paused``), reading from the engine pauses; :meth:`resume`
restarts it. Never raises into the event loop: a callback that raises is logged.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE

import logging

log = logging.getLogger("kvevents.gateway.upstream")

cdef enum State:
    SIZE = 0       # the chunk-size digits
    EXT = 1        # a chunk extension, skipped to its CR
    SIZE_LF = 2    # the LF after the size line
    DATA = 3       # the chunk's payload
    DATA_CR = 4    # the CR after it
    DATA_LF = 5    # the LF after it
    TRAILER = 6    # start of a trailer line, or the final CRLF
    TRAILER_LINE = 7
    FINAL_LF = 8
    DONE = 9

cdef bytes _END = b"0\r\n\r\n"  # the end of a chunked body, without trailers
cdef Py_ssize_t _LINE_MAX = 4096  # a size line or the trailers past this: malformed


cdef inline int _hex(unsigned char c) noexcept:
    if 48 <= c <= 57:
        return c - 48
    if 97 <= c <= 102:
        return c - 87
    if 65 <= c <= 70:
        return c - 55
    return -1


cdef class ChunkPump:
    """See the module docstring."""

    cdef object client          # the client's transport
    cdef object flow            # the server's flow control (write_paused), or None
    cdef object upstream        # the engine's transport, once attached
    cdef object on_first
    cdef object on_end
    cdef object on_lost         # the engine connection's own connection_lost
    cdef Py_ssize_t tail_size
    cdef Py_ssize_t hold_max
    cdef bytearray _tail
    cdef bytes held             # the start of an incomplete chunk, not yet written
    cdef list _out              # held for the client, before it is given (hold mode)
    cdef Py_ssize_t _out_size
    cdef State state
    cdef unsigned long long size
    cdef int digits
    cdef Py_ssize_t line        # bytes of the current size line / trailers so far
    cdef unsigned long long remaining
    cdef bint started
    cdef bint paused
    cdef readonly bint mid_chunk
    cdef readonly bint complete
    cdef readonly bint ended
    cdef bint finish            # the end marker goes out as 0 CRLF CRLF with the last chunks
    cdef readonly bint wrote_end
    cdef readonly Py_ssize_t extra  # bytes after the end marker (the connection is not reusable)
    cdef readonly object error

    def __init__(self, client, flow, on_first, on_end, on_lost, Py_ssize_t tail_size,
                 Py_ssize_t hold_max=65536):
        self.client = client
        self.flow = flow
        self.on_first = on_first
        self.on_end = on_end
        self.on_lost = on_lost
        self.tail_size = tail_size
        self.hold_max = hold_max
        self._tail = bytearray()
        self.held = b""
        self._out = []
        self.state = SIZE

    @property
    def holding(self):
        """No client yet: what would go to it is kept (see :meth:`start`)."""
        return self.client is None

    def start(self, client, flow, on_first, head=None, bint finish=False):
        """Hold mode ends: ``client`` gets ``head`` (the response's head, if the caller
        has not written it) and what was kept, in one write, and the rest as it comes;
        ``on_first()`` now if the body has started. ``finish``: the pump ends the
        client's answer itself at a clean end marker (``0\\r\\n\\r\\n`` in the write
        of the last chunks; :attr:`wrote_end` then says so), saving the caller a write."""
        self.client, self.flow, self.on_first = client, flow, on_first
        self.finish = finish
        out, self._out, self._out_size = self._out, [], 0
        if head is not None:
            out.insert(0, head)
        if self.complete and finish:
            out.append(_END)
            self.wrote_end = True
        if out:
            self._write(out[0] if len(out) == 1 else b"".join(out))
        if self.started:
            self._first()
        if self.paused and not self.ended and self.upstream is not None and not (
                flow is not None and flow.write_paused):
            self.paused = False
            self.upstream.resume_reading()

    def raw(self):
        """Hold mode: every byte of the body read so far and not yet parsed away (what
        was kept, then the incomplete chunk or the end marker), for a reader that takes
        the body another way; the pump is done with after this."""
        out = b"".join(self._out) + self.held
        self._out, self._out_size, self.held = [], 0, b""
        return out

    # -- set-up by the answer ------------------------------------------------------------

    def attach(self, upstream):
        """Become the protocol of the engine's transport (at the body's start)."""
        self.upstream = upstream
        upstream.set_protocol(self)

    def resume(self):
        """The client's socket drained: read from the engine again."""
        if self.paused and not self.ended and self.upstream is not None:
            self.paused = False
            self.upstream.resume_reading()

    def tail(self):
        """The last ``tail_size`` bytes of the decoded body."""
        return bytes(self._tail[-self.tail_size:]) if self.tail_size else b""

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport):
        self.upstream = transport

    def eof_received(self):
        return None  # close: connection_lost follows

    def pause_writing(self):
        pass  # the engine's side: only the request is written to it

    def resume_writing(self):
        pass

    def connection_lost(self, exc):
        if not self.ended:
            self._end("the engine closed the connection before the end of its answer"
                      + (f": {exc}" if exc else ""))
        lost, self.on_lost = self.on_lost, None
        if lost is not None:
            try:
                lost(exc)
            except Exception:
                log.exception("engine connection: connection_lost failed")

    def data_received(self, bytes data):
        cdef bytes buf
        cdef const unsigned char* p
        cdef Py_ssize_t n, i, take, boundary, cut, term, chunk_start
        cdef int v
        cdef State s
        cdef unsigned char c
        cdef bint keep_rest = True
        cdef object err = None
        if self.ended:
            self.extra += PyBytes_GET_SIZE(data)
            return
        # The held bytes (a chunk's start, parsed already) go out with the rest of it.
        i = PyBytes_GET_SIZE(self.held)
        buf = (self.held + data) if i else data
        self.held = b""
        p = <const unsigned char*> PyBytes_AS_STRING(buf)
        n = PyBytes_GET_SIZE(buf)
        boundary = 0   # after the last chunk complete in buf
        chunk_start = 0  # where the current (incomplete) chunk's size line began
        term = -1      # where the end marker's size line began
        while i < n:
            s = self.state
            if s == DATA:
                take = n - i
                if <unsigned long long> take > self.remaining:
                    take = <Py_ssize_t> self.remaining
                self._keep(buf, i, i + take)
                self.remaining -= take
                i += take
                if self.remaining == 0:
                    self.state = DATA_CR
                continue
            c = p[i]
            i += 1
            if s == SIZE:
                v = _hex(c)
                if v >= 0:
                    if self.digits >= 15:
                        err = "chunk size too large"
                        break
                    self.size = self.size * 16 + v
                    self.digits += 1
                elif self.digits and (c == 59 or c == 32 or c == 9):  # ';' or whitespace
                    self.state = EXT
                elif self.digits and c == 13:
                    self.state = SIZE_LF
                else:
                    err = "bad chunk size"
                    break
                self.line += 1
            elif s == EXT:
                if c == 13:
                    self.state = SIZE_LF
                self.line += 1
            elif s == SIZE_LF:
                if c != 10:
                    err = "bad chunk size line"
                    break
                self.line = 0
                if self.size == 0:
                    term = chunk_start
                    self.state = TRAILER
                else:
                    self.remaining = self.size
                    self.state = DATA
                    if not self.started:
                        self._first()
            elif s == DATA_CR:
                if c != 13:
                    err = "chunk longer than its size"
                    break
                self.state = DATA_LF
            elif s == DATA_LF:
                if c != 10:
                    err = "chunk longer than its size"
                    break
                boundary = chunk_start = i
                self.size = 0
                self.digits = 0
                self.state = SIZE
            elif s == TRAILER:
                self.state = FINAL_LF if c == 13 else TRAILER_LINE
                self.line += 1
            elif s == TRAILER_LINE:
                if c == 10:
                    self.state = TRAILER
                self.line += 1
            elif s == FINAL_LF:
                if c != 10:
                    err = "bad end of the chunked body"
                    break
                self.state = DONE
                self.complete = True
                self.extra += n - i
                break
            if self.line > _LINE_MAX:
                err = "chunk size line or trailers too long"
                break
        if err is not None:  # the complete chunks before it still go out
            if boundary > 0:
                self._write(buf if boundary == n else buf[:boundary])
            self._malformed(err)
            return
        # What the client gets now: every complete chunk; the incomplete one too when
        # it already started going out or is too big to hold, but never past the start
        # of a size line still arriving, nor the end marker.
        if term >= 0 or self.state >= TRAILER:  # the end marker: never written
            cut = term if term >= 0 else 0
            keep_rest = self.client is None  # (kept in hold mode, for raw())
            self.mid_chunk = False  # every chunk before the end marker is whole
        elif self.client is not None and (self.mid_chunk or n - boundary > self.hold_max):
            cut = chunk_start if self.state in (SIZE, EXT, SIZE_LF) else n
            self.mid_chunk = self.state not in (SIZE, EXT, SIZE_LF)
        else:
            cut = boundary
        if keep_rest and cut < n:
            self.held = buf[cut:]
        if self.complete and self.finish and self.client is not None:
            self.wrote_end = True  # the last chunks and the end in one write
            self._write(buf[:cut] + _END if cut > 0 else _END)
        elif cut > 0:
            self._write(buf if cut == n else buf[:cut])
        if self.client is None and self._out_size + PyBytes_GET_SIZE(self.held) > self.hold_max:
            self._pause()  # hold mode: what is kept stays bounded
        if self.complete:
            self._end(None)

    # -- internals -------------------------------------------------------------------------

    cdef void _keep(self, object buf, Py_ssize_t a, Py_ssize_t b):
        """The decoded bytes buf[a:b] into the tail, which stays under 2x its size."""
        cdef Py_ssize_t size = len(self._tail)
        if self.tail_size == 0:
            return
        if b - a >= self.tail_size:
            self._tail = bytearray(buf[b - self.tail_size:b])
            return
        self._tail += buf[a:b]
        if size + (b - a) > 2 * self.tail_size:
            del self._tail[:len(self._tail) - self.tail_size]

    cdef void _first(self):
        self.started = True
        if self.on_first is None:  # hold mode: start() calls it
            return
        first, self.on_first = self.on_first, None
        try:
            first()
        except Exception:
            log.exception("relay: on_first failed")

    cdef void _write(self, object data):
        client = self.client
        if client is None:  # hold mode: kept (bounded by the caller)
            self._out.append(data)
            self._out_size += len(data)
            return
        if client.is_closing():
            return  # the client left: its watcher closes the engine's stream
        client.write(data)
        flow = self.flow
        if flow is not None and flow.write_paused:
            self._pause()

    cdef void _pause(self):
        """Stop reading from the engine (:meth:`resume` or :meth:`start` restarts it)."""
        if not self.paused and self.upstream is not None:
            self.paused = True
            self.upstream.pause_reading()

    cdef object _malformed(self, str why):
        self._end("malformed answer: " + why)
        if self.upstream is not None:
            self.upstream.close()
        return None

    cdef void _end(self, object error):
        if self.ended:
            return
        self.ended = True
        self.error = error
        end, self.on_end = self.on_end, None
        try:
            end(error)
        except Exception:
            log.exception("relay: on_end failed")
