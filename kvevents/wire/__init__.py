"""The wire contract, byte-compatible with vLLM's KV events (no index, no HTTP).

Files, one concept each::

    schema.py     the events and batches (msgspec Structs), both vLLM encodings,
                  the decoder and encoder of a payload
    framing.py    frames and the seq codec, the one replay-reply parser, endpoint rules
                  (bind-or-connect, data-parallel offsets, what a subscriber can use)
    publisher.py  the never-blocking ZeroMQ publisher with its replay ROUTER socket

Everything above (``ingest``, the index, the service, ``connector/``) speaks the wire
through this package; it imports nothing else of ours, and needs only pyzmq and msgspec.
"""
