"""dnsmasq (Debian package dnsmasq-base) as a real DNS server for the discovery tests:
answers for ``*.test`` from a hosts file the test rewrites, on 127.0.0.1 and a free port."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import dns.resolver
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from support import wait_until  # noqa: E402


def _require_dnsmasq() -> str:
    """Missing: skip locally, fail under CI (as tests/support.py's require_binary)."""
    path = shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.access(p, os.X_OK)), None)
    if path is None:
        msg = "dnsmasq is not installed (Debian package 'dnsmasq-base'; `make test` installs it as root)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def _closed_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



class Dnsmasq:
    """dnsmasq in the foreground, answering for ``*.test`` only from ``hosts``
    (``--local=/test/``: an unknown name there is NXDOMAIN, anything else REFUSED)."""

    def __init__(self, tmp_path, lines: list[str]) -> None:
        binary = _require_dnsmasq()
        self.hosts = tmp_path / "hosts"
        self.log = tmp_path / "dnsmasq.log"
        self._write(lines)
        for _ in range(3):  # the free port may be taken between probe and bind
            self.port = _closed_udp_port()
            self.cmd = [binary, "--keep-in-foreground", "--no-resolv", "--no-hosts",
                        f"--addn-hosts={self.hosts}", "--local=/test/",
                        "--listen-address=127.0.0.1", "--bind-interfaces", f"--port={self.port}",
                        "--pid-file=", "--log-facility=-", "--cache-size=0"]
            if os.geteuid() == 0:  # root: it would drop to nobody, who cannot read tmp_path
                self.cmd += ["--user=root", "--group=root"]
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
            if wait_until(self._answers, 5):
                return
            self.close()
        raise RuntimeError(f"dnsmasq did not start: {self.cmd}\n{self.log.read_text()}")

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            return False
        r = dns.resolver.Resolver(configure=False)
        r.nameservers, r.port = ["127.0.0.1"], self.port
        try:
            r.resolve("probe.test", "A", lifetime=0.3)
        except dns.resolver.NXDOMAIN:
            return True
        except Exception:
            return False
        return True

    def _write(self, lines: list[str]) -> None:
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{line}\n" for line in lines))
        tmp.replace(self.hosts)  # atomic: a SIGHUP never reads half a file

    def set_hosts(self, lines: list[str]) -> None:
        self._write(lines)
        self.proc.send_signal(signal.SIGHUP)  # dnsmasq re-reads --addn-hosts on SIGHUP

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(3)
