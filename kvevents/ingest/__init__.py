"""Ingest plumbing around the subscriber: socket/file budget, log rate limiting, memory
release after floods, and batch digests for continuity checks (one concept a module)."""
