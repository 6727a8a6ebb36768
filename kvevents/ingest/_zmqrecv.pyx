# cython: language_level=3, boundscheck=False, wraparound=False
"""Drain whole ZeroMQ messages from a socket in one call, straight through libzmq.

Why: the aggregator's ingest thread receives tens of thousands of small 3-frame vLLM
messages a second. Through pyzmq each frame costs a ``recv`` plus a ``getsockopt
(RCVMORE)`` (about 2 us each here, most of it Python-level option handling), so
receiving was a fifth of the ingest thread. Here one call reads up to ``max_msgs``
messages with ``zmq_msg_recv`` / ``zmq_msg_more`` and returns them as lists of
``bytes``, the same values ``recv_multipart(NOBLOCK)`` returns.

libzmq is the copy pyzmq already loaded in this process: it is found in
``/proc/self/maps`` and its symbols are taken with ``dlsym``, so nothing links against
libzmq at build time and the versions always match. Where that is not possible (not
Linux, a libzmq linked statically into pyzmq, libzmq < 4.1 whose message struct is
smaller) :func:`load` raises ``OSError`` and callers use pyzmq's calls instead.

Lifecycle: :func:`load` once per process; :func:`drain` only from the thread that owns
the socket (ZeroMQ sockets are not thread-safe) and only on an open socket.

Also here (``_lane.pxi``): each source's stream :class:`Cursor` and :class:`DigestRing`,
and ``Cursor.lane_drain``, the same drain that hands a source's in-order batches to a
compiled sink without the GIL.
"""

cimport cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport uintptr_t

cdef extern from "<dlfcn.h>" nogil:
    void* dlopen(const char* filename, int flag)
    void* dlsym(void* handle, const char* symbol)
    int RTLD_NOW
    int RTLD_NOLOAD

cdef extern from "<errno.h>":
    int EAGAIN
    int EINTR

# libzmq >= 4.1: ``typedef struct zmq_msg_t { unsigned char _[64]; } zmq_msg_t`` with
# pointer alignment; eight pointers give both the size and the alignment.
ctypedef struct zmq_msg_t:
    void* _opaque[8]

ctypedef int (*msg_init_f)(zmq_msg_t*) noexcept nogil
ctypedef int (*msg_recv_f)(zmq_msg_t*, void*, int) noexcept nogil
ctypedef void* (*msg_data_f)(zmq_msg_t*) noexcept nogil
ctypedef size_t (*msg_size_f)(const zmq_msg_t*) noexcept nogil
ctypedef int (*msg_more_f)(const zmq_msg_t*) noexcept nogil
ctypedef int (*msg_close_f)(zmq_msg_t*) noexcept nogil
ctypedef int (*errno_f)() noexcept nogil
ctypedef void (*version_f)(int*, int*, int*) noexcept nogil

cdef msg_init_f z_init = NULL
cdef msg_recv_f z_recv = NULL
cdef msg_data_f z_data = NULL
cdef msg_size_f z_size = NULL
cdef msg_more_f z_more = NULL
cdef msg_close_f z_close = NULL
cdef errno_f z_errno = NULL

cdef int ZMQ_DONTWAIT = 1


@cython.wraparound(True)
def _libzmq_path():
    """Path of the libzmq shared object mapped into this process, or None."""
    try:
        with open("/proc/self/maps", "rb") as f:
            for line in f:
                path = line.rsplit(None, 1)[-1]
                name = path.rsplit(b"/", 1)[-1]
                if path.startswith(b"/") and name.startswith(b"libzmq") and b".so" in name:
                    return path
    except OSError:
        return None
    return None


def load():
    """Resolve libzmq's message functions from pyzmq's libzmq. Idempotent.

    Raises ``OSError`` (with the reason) when it cannot; nothing is changed then.
    """
    global z_init, z_recv, z_data, z_size, z_more, z_close, z_errno
    if z_recv != NULL:
        return
    import zmq  # loads libzmq into the process if nothing did yet
    path = _libzmq_path()
    if path is None:
        raise OSError("no shared libzmq mapped in this process")
    cdef void* h = dlopen(path, RTLD_NOW | RTLD_NOLOAD)
    if h == NULL:
        raise OSError(f"dlopen({path!r}) failed")
    cdef int major = 0, minor = 0, patch = 0
    cdef version_f ver = <version_f>dlsym(h, b"zmq_version")
    if ver == NULL:
        raise OSError("libzmq has no zmq_version")
    ver(&major, &minor, &patch)
    if (major, minor) < (4, 1):
        raise OSError(f"libzmq {major}.{minor}.{patch} < 4.1 (64-byte zmq_msg_t)")
    cdef void* syms[7]
    names = (b"zmq_msg_init", b"zmq_msg_recv", b"zmq_msg_data", b"zmq_msg_size",
             b"zmq_msg_more", b"zmq_msg_close", b"zmq_errno")
    for i, name in enumerate(names):
        syms[i] = dlsym(h, name)
        if syms[i] == NULL:
            raise OSError(f"libzmq has no {name.decode()}")
    z_init = <msg_init_f>syms[0]
    z_data = <msg_data_f>syms[2]
    z_size = <msg_size_f>syms[3]
    z_more = <msg_more_f>syms[4]
    z_close = <msg_close_f>syms[5]
    z_errno = <errno_f>syms[6]
    z_recv = <msg_recv_f>syms[1]  # last: it marks the module loaded


def drain(uintptr_t handle, int max_msgs, Py_ssize_t max_bytes, list out):
    """Append up to ``max_msgs`` whole messages waiting on the socket whose libzmq handle
    is ``handle`` (pyzmq's ``Socket.underlying``) to ``out``, each a list of ``bytes``
    frames; never waits. Stops early once the messages taken hold ``max_bytes`` or more
    (a flood of large messages stays in libzmq's bounded queue, not in Python memory).
    Returns how many were appended.

    Raises ``OSError(errno)`` on a receive error other than "nothing waiting" or an
    interrupt (messages appended before it stay in ``out``). A message's frames arrive
    together, so a message is never split between calls.
    """
    if z_recv == NULL:
        raise OSError("libzmq functions not loaded; call load() first")
    cdef void* sock = <void*>handle
    cdef zmq_msg_t msg
    cdef int n = 0, rc, err, more = 0
    cdef Py_ssize_t taken = 0, size
    cdef list frames
    while n < max_msgs:
        frames = None
        while True:
            z_init(&msg)
            rc = z_recv(&msg, sock, ZMQ_DONTWAIT)
            if rc < 0:
                err = z_errno()
                z_close(&msg)
                if frames is not None:  # cannot happen (atomic delivery); keep what came
                    out.append(frames)
                    n += 1
                if err == EAGAIN or err == EINTR:
                    return n
                raise OSError(err, "zmq_msg_recv failed")
            if frames is None:
                frames = []
            size = <Py_ssize_t>z_size(&msg)
            taken += size
            try:
                frames.append(PyBytes_FromStringAndSize(<char*>z_data(&msg), size))
                more = z_more(&msg)
            finally:
                z_close(&msg)  # also when the copy failed (MemoryError): no leaked message
            if not more:
                break
        out.append(frames)
        n += 1
        if taken >= max_bytes:
            break
    return n


include "_lane.pxi"
