# The C interface between the ingest lane (kvevents/ingest/_lane.pxi, which receives and
# checks each live message without the GIL) and a consumer's compiled sink that applies
# the payload (kvevents/index/_sink.pxi). Declarations only: nothing is imported at run
# time; the sink is handed over as a PyCapsule named LANE_SINK_CAPSULE holding a
# ``LaneSink*``.
#
# ``apply(ctx, seq, payload, size, ts)`` runs without the GIL for the next in-order
# batch of the sink's source. It returns:
#   0  applied (``ts`` set to the batch's timestamp);
#   1  declined, nothing changed: the batch must take the Python path (an uncommon
#      shape, a tier or namespace not known to the sink yet, a sink no longer valid);
#   2  failed part way (the sink keeps the exception): the seq counts as delivered and
#      the consumer must rebuild the source (see the sink's ``take_error``).

from libc.stdint cimport int64_t, uint8_t, uint64_t

ctypedef int (*lane_apply_f)(void* ctx, uint64_t seq, const uint8_t* payload,
                             Py_ssize_t size, double* ts) noexcept nogil

ctypedef struct LaneSink:
    lane_apply_f apply
    void* ctx
