"""Headless Chromium driven over the DevTools protocol, for tests of the live page.

A tiny stdlib WebSocket client (the page keeps an EventSource open, so ``--dump-dom``
would dump it at the load event, before any live update, and ``--virtual-time-budget``
never elapses while a stream is pending). ``READ_PAGE`` reads the page's figures back
from its stable DOM hooks.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import subprocess
from pathlib import Path
from urllib.parse import urlparse

import httpx

from support import wait_until

CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
    "--disable-dev-shm-usage", "--window-size=1400,1000", "--remote-debugging-port=0",
]


class DevTools:
    """A minimal DevTools-protocol client: one WebSocket, request/response by id.

    Just enough RFC 6455 for CDP: masked text frames out, unmasked (possibly
    fragmented) text frames in; events interleaved with responses are skipped.
    """

    def __init__(self, ws_url: str, timeout: float = 10.0) -> None:
        u = urlparse(ws_url)
        self._sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self._sock.sendall(
            f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n"
            .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self._sock.recv(1)
            if not chunk:
                raise ConnectionError("DevTools closed the connection during the handshake")
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"DevTools refused the WebSocket: {head[:80]!r}")
        self._next_id = 0

    def _recv_exact(self, n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("DevTools closed the connection")
            buf += chunk
        return buf

    def _send_text(self, text: str) -> None:
        payload = text.encode()
        n = len(payload)
        head = bytes([0x81])
        if n < 126:
            head += bytes([0x80 | n])
        elif n < 65536:
            head += bytes([0x80 | 126]) + struct.pack("!H", n)
        else:
            head += bytes([0x80 | 127]) + struct.pack("!Q", n)
        mask = os.urandom(4)
        self._sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def _recv_message(self) -> str:
        parts = []
        while True:
            b0, b1 = self._recv_exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._recv_exact(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._recv_exact(8))[0]
            data = self._recv_exact(n)
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("DevTools closed the WebSocket")
            if opcode in (0x1, 0x0):
                parts.append(data)
                if b0 & 0x80:
                    return b"".join(parts).decode()
            # ping/pong and binary frames are not used by DevTools: ignore them

    def call(self, method: str, **params) -> dict:
        self._next_id += 1
        self._send_text(json.dumps({"id": self._next_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self._recv_message())
            if msg.get("id") == self._next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]

    def evaluate(self, expression: str):
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in res:
            raise RuntimeError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def close(self) -> None:
        self._sock.close()


class Browser:
    """Headless Chromium opened on ``url`` with a DevTools client on its page."""

    def __init__(self, binary: str, url: str, profile: Path) -> None:
        self._log = open(profile.parent / "chromium.log", "w")
        self.proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", url],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        port_file = profile / "DevToolsActivePort"
        if not wait_until(lambda: port_file.exists() and port_file.read_text().count("\n") >= 1, 20, 0.05):
            self.close()
            raise RuntimeError("chromium did not open its DevTools port")
        port = int(port_file.read_text().split()[0])
        pages: list[dict] = []

        def page_listed() -> bool:
            try:
                targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
            except httpx.HTTPError:
                return False
            pages[:] = [t for t in targets if t.get("type") == "page" and t["url"].startswith(url)]
            return bool(pages)

        if not wait_until(page_listed, 15, 0.1):
            self.close()
            raise RuntimeError("chromium did not open the page")
        self.tools = DevTools(pages[0]["webSocketDebuggerUrl"])
        # The window's chrome takes some of --window-size: make the viewport exactly it.
        self.tools.call("Emulation.setDeviceMetricsOverride", width=1400, height=1000,
                        deviceScaleFactor=1, mobile=False)

    def screenshot(self, path: Path) -> None:
        data = self.tools.call("Page.captureScreenshot", format="png")["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        tools = getattr(self, "tools", None)
        if tools is not None:
            tools.close()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._log.close()


READ_PAGE = """(() => {
  const q = (s) => document.querySelector(s);
  const rows = [...document.querySelectorAll('#engines tbody tr[data-engine]')].map((tr) => {
    const f = (name) => tr.querySelector(`[data-field="${name}"]`);
    const tiers = {};
    for (const t of tr.querySelectorAll('[data-tier]')) tiers[t.dataset.tier] = Number(t.dataset.blocks);
    return {engine: tr.dataset.engine, status: tr.dataset.status, connected: f('connected').dataset.value,
            last_seq: f('last_seq').dataset.value, lag: f('lag').dataset.value,
            gaps: Number(f('gaps').dataset.value), replayed: Number(f('replayed').dataset.value),
            lost: Number(f('lost').dataset.value), restarts: Number(f('restarts').dataset.value),
            text: tr.innerText, tiers};
  });
  const hit = {};
  for (const r of document.querySelectorAll('#hit-rate [data-tier]')) {
    hit[r.dataset.tier] = Number(r.dataset.ratio);
  }
  return {
    summaries: Number(document.body.dataset.summaries), conn: q('#conn').dataset.state, rows,
    batches_per_s: Number(q('#event-rate').dataset.batchesPerS),
    blocks_per_s: Number(q('#event-rate').dataset.blocksPerS),
    entries: Number(q('#index-size').dataset.entries), distinct: Number(q('#index-size').dataset.distinct),
    lookups: Number(q('#lookups').dataset.lookups), hit,
    prefixes: [...document.querySelectorAll('#prefixes tr[data-prefix]')].map((tr) => ({
      tokens: Number(tr.dataset.tokens),
      engines: [...tr.querySelectorAll('.chip[data-engine]')].map((c) => c.dataset.engine)})),
    log: [...document.querySelectorAll('#log li[data-kind]')].map((li) => [li.dataset.kind, li.innerText]),
  };
})()"""
