"""dnsmasq (Debian package dnsmasq-base) as a real DNS server for the discovery tests:
answers from a hosts file the test rewrites, on 127.0.0.1 and a free port.

Configurations: ``local`` (default True) adds ``--local=/test/``: dnsmasq is then the
authority for ``*.test``, an unknown name there is NXDOMAIN and a missing family NODATA.
Without it dnsmasq behaves as a plain forwarder with no upstream: a family it has no
record for (AAAA of an IPv4-only name), or a name it does not hold, is REFUSED.
``srv`` adds ``--srv-host`` records (``_SERVICE._PROTO.DOMAIN,TARGET,PORT``);
``extra`` any other options."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import dns.message
import dns.query
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
    """dnsmasq in the foreground, answering from ``hosts`` (see the module docstring)."""

    def __init__(self, tmp_path, lines: list[str], *, local: bool = True, srv: list[str] = (),
                 extra: list[str] = ()) -> None:
        self.binary = _require_dnsmasq()
        self.hosts = tmp_path / "hosts"
        self.log = tmp_path / "dnsmasq.log"
        self.options = (["--local=/test/"] if local else []) + [f"--srv-host={s}" for s in srv] + list(extra)
        self._write(lines)
        for _ in range(3):  # the free port may be taken between probe and bind
            self.port = _closed_udp_port()
            if self._start():
                return
        raise RuntimeError(f"dnsmasq did not start: {self.cmd}\n{self.log.read_text()}")

    def _start(self) -> bool:
        self.cmd = [self.binary, "--keep-in-foreground", "--no-resolv", "--no-hosts",
                    f"--addn-hosts={self.hosts}", *self.options,
                    "--listen-address=127.0.0.1", "--bind-interfaces", f"--port={self.port}",
                    "--pid-file=", "--log-facility=-", "--cache-size=0"]
        if os.geteuid() == 0:  # root: it would drop to nobody, who cannot read tmp_path
            self.cmd += ["--user=root", "--group=root"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        if wait_until(self._answers, 5):
            return True
        self.close()
        return False

    def restart(self, *, srv: list[str] | None = None, local: bool | None = None) -> None:
        """The same port, new options (dnsmasq re-reads only its hosts files on SIGHUP)."""
        self.close()
        keep = [o for o in self.options if not o.startswith(("--srv-host=", "--local="))]
        was_local = any(o.startswith("--local=") for o in self.options)
        srv_opts = ([f"--srv-host={s}" for s in srv] if srv is not None
                    else [o for o in self.options if o.startswith("--srv-host=")])
        self.options = (["--local=/test/"] if (was_local if local is None else local) else []) + srv_opts + keep
        if not wait_until(self._start, 10, 0.2):
            raise RuntimeError(f"dnsmasq did not restart: {self.cmd}\n{self.log.read_text()}")

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        """Any response at all (NXDOMAIN with --local, REFUSED without) means it is up."""
        if self.proc.poll() is not None:
            return False
        try:
            dns.query.udp(dns.message.make_query("probe.test.", "A"), "127.0.0.1", timeout=0.3,
                          port=self.port)
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
