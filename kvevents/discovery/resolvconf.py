"""The system resolver's settings as glibc reads them, and so as a Kubernetes pod resolves:
:func:`read_resolv_conf`, :func:`search_candidates`, :func:`hosts_addresses`.

A pod's ``/etc/resolv.conf`` names the cluster DNS, ``search NAMESPACE.svc.cluster.local
svc.cluster.local cluster.local ...`` and ``options ndots:5``, so a short name such as
``vllm-headless`` is asked as ``vllm-headless.NAMESPACE.svc.cluster.local.`` first.
:func:`search_candidates` gives the names to ask in glibc's order (``res_search``): a
name with at least ``ndots`` dots is tried as given first, one with fewer is tried
with each search domain first, a name ending in ``.`` is absolute and tried alone.

What is read: ``nameserver`` (the first three, as glibc), ``search`` / ``domain`` (the
last one wins; with neither there are no search domains, where glibc would take the
host name's domain), ``options ndots:N``. Other options (``timeout``, ``attempts``,
``rotate``...) are not used: each server gets the source's own timeout once per round,
and the next round asks again. One extension: ``nameserver IP:PORT`` /
``[IPV6]:PORT`` names a server on another port than 53 (glibc cannot; it is there for
local resolvers and tests). A file that is missing or names no usable server gives
glibc's default, ``127.0.0.1`` port 53.

Failure: nothing here raises for a bad file; lines that cannot be used are listed in
:attr:`ResolvConf.ignored` (shown on ``GET /v1/discovery``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

__all__ = ["DEFAULT_HOSTS", "DEFAULT_RESOLV_CONF", "ResolvConf", "hosts_addresses", "parse_server",
           "read_resolv_conf", "search_candidates"]

DEFAULT_RESOLV_CONF = "/etc/resolv.conf"
DEFAULT_HOSTS = "/etc/hosts"
_MAXNS = 3  # glibc's MAXNS: later nameserver lines are ignored
_MAX_NDOTS = 15  # glibc's RES_MAXNDOTS
_MAX_NAME = 253  # a name longer than this (without the root dot) cannot be asked


def parse_server(text: str) -> tuple[str, int]:
    """``HOST[:PORT]`` / ``[V6][:PORT]`` / bare ``V6`` to (IP, port); port 53 by default.
    Only IP literals: the server is what resolves names, so it cannot be one.
    Raises ``ValueError`` naming ``dns-server``."""
    text = text.strip()
    host, port = text, "53"
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"dns-server: expected [IPV6]:PORT, got {text!r}")
        port = rest[1:] if rest else "53"
    elif text.count(":") == 1:
        host, port = text.split(":")
    try:
        address = ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(f"dns-server: expected IP[:PORT] or [IPV6]:PORT, got {text!r}") from None
    if not 0 < number < 65536:
        raise ValueError(f"dns-server: port must be 1..65535, got {text!r}")
    return str(address), number


@dataclass(frozen=True)
class ResolvConf:
    """What a resolv.conf says (see the module docstring)."""

    path: str
    nameservers: tuple[tuple[str, int], ...] = (("127.0.0.1", 53),)
    search: tuple[str, ...] = ()
    ndots: int = 1
    found: bool = True  # False: the file could not be read, these are glibc's defaults
    ignored: tuple[str, ...] = ()  # lines that could not be used, with why

    def describe(self) -> dict:
        return {"path": self.path, "found": self.found, "ndots": self.ndots,
                "search": list(self.search),
                "nameservers": [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nameservers],
                "ignored": list(self.ignored)}


def read_resolv_conf(path: str = DEFAULT_RESOLV_CONF) -> ResolvConf:
    """Parse ``path``; never raises (an unreadable file gives the defaults, ``found`` False)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(65536)
    except OSError as exc:
        return ResolvConf(path=path, found=False, ignored=(f"{path}: {exc.strerror or exc}",))
    servers: list[tuple[str, int]] = []
    search: tuple[str, ...] = ()
    ndots = 1
    ignored: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        words = raw.split("#", 1)[0].split(";", 1)[0].split()
        if not words:
            continue
        key, args = words[0], words[1:]
        if key == "nameserver" and args:
            try:
                server = parse_server(args[0])
            except ValueError as exc:
                ignored.append(f"line {number}: {exc}")
                continue
            if len(servers) < _MAXNS:
                servers.append(server)
            else:
                ignored.append(f"line {number}: more than {_MAXNS} nameservers")
        elif key == "search":
            search = tuple(d.rstrip(".") for d in args if d.rstrip("."))
        elif key == "domain" and args:
            search = (args[0].rstrip("."),) if args[0].rstrip(".") else ()
        elif key == "options":
            for option in args:
                if option.startswith("ndots:"):
                    try:
                        ndots = min(max(int(option[6:]), 0), _MAX_NDOTS)
                    except ValueError:
                        ignored.append(f"line {number}: bad {option!r}")
    return ResolvConf(path=path, nameservers=tuple(servers) or (("127.0.0.1", 53),),
                      search=search, ndots=ndots, ignored=tuple(ignored))


def search_candidates(name: str, conf: ResolvConf) -> list[str]:
    """The absolute names to ask for ``name``, in glibc's order (module docstring)."""
    if name.endswith("."):
        return [name]
    dots = name.count(".")
    searched = [f"{name}.{domain}." for domain in conf.search]
    ordered = [f"{name}."] + searched if dots >= conf.ndots else searched + [f"{name}."]
    return [c for c in dict.fromkeys(ordered) if len(c) - 1 <= _MAX_NAME]


def hosts_addresses(name: str, path: str = DEFAULT_HOSTS) -> list[str]:
    """The addresses ``path`` (an ``/etc/hosts``) gives ``name`` (as glibc's ``files``
    source: the name as written, any case, no search domains); [] when none or unreadable."""
    wanted = name.rstrip(".").lower()
    out: list[str] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read(1 << 20).splitlines()
    except OSError:
        return []
    for line in lines:
        words = line.split("#", 1)[0].split()
        if len(words) >= 2 and wanted in (w.lower() for w in words[1:]):
            try:
                out.append(str(ipaddress.ip_address(words[0].split("%", 1)[0])))
            except ValueError:
                continue  # not an address: glibc skips the line too
    return list(dict.fromkeys(out))
