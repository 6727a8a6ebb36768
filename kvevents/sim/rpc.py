"""The request socket and loop an engine process serves (the protocol is in
:mod:`kvevents.sim.process`): a ROUTER socket taking msgpack maps with an ``op``.

Lifecycle: a subclass builds its engine, then calls ``EngineRpc.__init__`` to bind;
:meth:`serve` runs until a ``stop`` request (or ``running`` is cleared by a signal
handler) and closes the engine and the socket in ``finally``. Failure: a request that
is not a msgpack map with an ``op``, an unknown op, or one its handler rejects with
``KeyError``/``ValueError``/``TypeError`` is answered ``{"op": "error", ...}`` and
changes nothing; the loop goes on.
"""

from __future__ import annotations

import signal
from typing import Any

import msgspec
import zmq


class EngineRpc:
    """Subclasses implement :meth:`on_request`, :meth:`has_work`, :meth:`step` and
    :meth:`close`."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context.instance()
        self.rpc = self.ctx.socket(zmq.ROUTER)
        self.rpc.setsockopt(zmq.LINGER, 0)
        self.rpc.bind(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(dict)
        self.running = True

    # -- for subclasses ------------------------------------------------------------------

    def on_request(self, ident: bytes, op: str, msg: dict[str, Any]) -> bool:
        """Handle ``op`` (replying when it has an answer); False for an unknown op."""
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> None:
        """One engine step; finished requests are answered from here."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the engine (called once, when :meth:`serve` ends)."""

    # -- the loop ------------------------------------------------------------------------

    def reply(self, ident: bytes, msg: dict[str, Any]) -> None:
        self.rpc.send_multipart((ident, self._enc.encode(msg)))

    def handle(self, ident: bytes, payload: bytes) -> None:
        try:
            msg = self._dec.decode(payload)
            op = msg["op"]
        except (msgspec.DecodeError, KeyError, TypeError):
            self.reply(ident, {"op": "error", "error": "expected a msgpack map with 'op'"})
            return
        try:
            if op == "stop":
                self.running = False
                self.reply(ident, {"op": "stopped"})
            elif not self.on_request(ident, op, msg):
                self.reply(ident, {"op": "error", "error": f"unknown op {op!r}"})
        except (KeyError, ValueError, TypeError) as exc:
            # A rejected submit names its request, so the client can account for it.
            self.reply(ident, {"op": "error", "id": msg.get("id"), "error": f"{op}: {exc}"})

    def serve_until_signalled(self, ready_line: str) -> int:
        """A process's main loop: SIGTERM/SIGINT end it like a ``stop`` request; prints
        ``ready_line`` (what the parent waits for) once the socket is bound. Returns 0."""
        def _stop(*_: object) -> None:
            self.running = False

        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        print(ready_line, flush=True)
        self.serve()
        return 0

    def serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.rpc, zmq.POLLIN)
        try:
            while self.running:
                if poller.poll(0 if self.has_work() else 50):
                    # Take every waiting request before stepping, so one step sees them.
                    while True:
                        try:
                            ident, payload = self.rpc.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        except ValueError:  # wrong frame count
                            continue
                        self.handle(ident, payload)
                if self.has_work():
                    self.step()
        finally:
            try:
                self.close()
            finally:
                self.rpc.close(0)
