"""docker-compose.yml, the Dockerfile and the files they mount hang together.

No Docker engine runs in CI, so the compose file is checked structurally: every service
is there, every flag parses with the real argument parsers (the aggregator's pod specs
with :meth:`PodSpec.parse`, the engines' with ``kvevents.sim.process``), every port
a scraper or the aggregator dials is one a service listens on, every mounted file exists.
The YAML files are read by a small strict reader (below) so the suite needs no PyYAML;
it raises on any construct it does not know instead of guessing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from support import require_binary
from kvevents.settings import PodSpec

ROOT = Path(__file__).resolve().parent.parent
ENGINES = [f"engine-{i}" for i in range(4)]


# -- a strict reader for the YAML subset these files use ----------------------------------

_PLAIN_KEY = re.compile(r"^([A-Za-z0-9_.\-/]+|\"[^\"]*\"|'[^']*'):(\s+|$)")


def _strip_comment(line: str) -> str:
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return line[:i].rstrip()
    return line.rstrip()


def _scalar(text: str):
    text = text.strip()
    if text[:1] in "&*|>{!%@`":
        raise ValueError(f"YAML construct not supported by this reader: {text!r}")
    if text.startswith("["):
        if not text.endswith("]"):
            raise ValueError(f"multi-line flow sequences are not supported: {text!r}")
        inner = text[1:-1].strip()
        if not inner:
            return []
        items, cur, quote = [], "", None
        for ch in inner:
            if quote:
                quote = None if ch == quote else quote
            elif ch in "\"'":
                quote = ch
            elif ch == ",":
                items.append(cur)
                cur = ""
                continue
            cur += ch
        items.append(cur)
        return [_scalar(i) for i in items]
    if text.startswith('"'):
        return json.loads(text)
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    if text in ("true", "false"):
        return text == "true"
    if text in ("null", "~", ""):
        return None
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    return text


def read_yaml(path: Path):
    lines = []
    for raw in path.read_text().splitlines():
        if "\t" in raw[: len(raw) - len(raw.lstrip())]:
            raise ValueError(f"{path}: tab indentation")
        line = _strip_comment(raw)
        if line.strip() and line.strip() != "---":
            lines.append([len(line) - len(line.lstrip()), line.strip()])

    def block(i: int, indent: int):
        if lines[i][1].startswith("- ") or lines[i][1] == "-":
            return seq(i, indent)
        return mapping(i, indent)

    def seq(i: int, indent: int):
        out = []
        def is_item(j: int) -> bool:
            return lines[j][0] == indent and (lines[j][1].startswith("- ") or lines[j][1] == "-")

        while i < len(lines) and is_item(i):
            item = lines[i][1][1:].strip()
            if not item:
                value, i = block(i + 1, lines[i + 1][0])
            elif _PLAIN_KEY.match(item):  # "- key: value" opens a mapping
                lines[i] = [indent + 2, item]
                value, i = mapping(i, indent + 2)
            else:
                value, i = _scalar(item), i + 1
            out.append(value)
        return out, i

    def mapping(i: int, indent: int):
        out = {}
        while i < len(lines) and lines[i][0] == indent:
            m = _PLAIN_KEY.match(lines[i][1])
            if not m:
                raise ValueError(f"{path}: expected 'key: value', got {lines[i][1]!r}")
            key = _scalar(m.group(1))
            if key in out:
                raise ValueError(f"{path}: duplicate key {key!r}")
            rest = lines[i][1][m.end():]
            i += 1
            if rest:
                out[key] = _scalar(rest)
            elif i < len(lines) and (lines[i][0] > indent or (
                    lines[i][0] == indent and lines[i][1].startswith("- "))):
                out[key], i = block(i, lines[i][0])
            else:
                out[key] = None
        return out, i

    value, end = block(0, lines[0][0])
    if end != len(lines):
        raise ValueError(f"{path}: could not read line {lines[end]!r}")
    return value


def test_yaml_reader_agrees_with_known_shapes(tmp_path):
    f = tmp_path / "x.yml"
    f.write_text("a: 1  # c\nb:\n  - x\n  - k: 'v'\n    n: [1, \"2, 3\"]\nc:\n- d\ne: \"#no\"\n")
    assert read_yaml(f) == {"a": 1, "b": ["x", {"k": "v", "n": [1, "2, 3"]}], "c": ["d"], "e": "#no"}
    f.write_text("a: &anchor 1\n")
    with pytest.raises(ValueError):
        read_yaml(f)


# -- the files ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compose() -> dict:
    return read_yaml(ROOT / "docker-compose.yml")


def _flag(args: list[str], name: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == name]


def _container_ports(service: dict) -> set[int]:
    ports = {int(p) for p in service.get("expose", [])}
    for p in service.get("ports", []):
        ports.add(int(str(p).rsplit(":", 1)[-1].split("/")[0]))
    return ports


def test_services_and_build(compose):
    services = compose["services"]
    assert set(services) == {"aggregator", *ENGINES, "prometheus", "grafana"}
    for name in ["aggregator", *ENGINES]:
        assert services[name]["build"] == ".", name
        assert services[name]["image"] == "kvevents:latest", name
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert re.search(r"pip install torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu",
                     dockerfile)
    assert 'pip install ".[connector]"' in dockerfile
    for src in re.findall(r"^COPY (.+) \S+$", dockerfile, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert ".venv" in ignored and ".git" in ignored
    assert not ignored & {"kvevents", "connector", "pyproject.toml", "README.md"}


def test_aggregator_follows_every_engine(compose):
    agg = compose["services"]["aggregator"]
    cmd = [str(a) for a in agg["command"]]
    assert cmd[:2] == ["kvevents", "serve"]
    assert _flag(cmd, "--host") == ["0.0.0.0"] and _flag(cmd, "--port") == ["8000"]
    assert "8000:8000" in agg["ports"]
    specs = [PodSpec.parse(e) for e in _flag(cmd, "--endpoint")]  # the CLI's own parser
    assert [s.name for s in specs] == ENGINES
    engine_args = {name: _engine_args(compose, name) for name in ENGINES}
    for spec in specs:
        assert spec.endpoint == f"tcp://{spec.name}:{engine_args[spec.name].events_port}"
        assert spec.replay_endpoint == f"tcp://{spec.name}:{engine_args[spec.name].replay_port}"
    assert set(agg["depends_on"]) == set(ENGINES)


def _engine_args(compose: dict, name: str):
    from kvevents.sim.process import parse_args  # the engine's real flags

    cmd = [str(a) for a in compose["services"][name]["command"]]
    assert cmd[:3] == ["python", "-m", "kvevents.sim.process"], cmd
    return parse_args(cmd[3:])


def test_engines_listen_where_they_are_dialled_and_scraped(compose):
    for name in ENGINES:
        args = _engine_args(compose, name)
        assert args.name == name
        assert args.bind == "*"  # reachable from the other containers
        ports = (args.events_port, args.replay_port, args.metrics_port, args.rpc_port)
        assert ports == (5557, 5558, 9100, 5560), name
        listening = _container_ports(compose["services"][name])
        assert {5557, 5558, 5560, 9100} <= listening, name
    prom = read_yaml(ROOT / "dashboard/prometheus/prometheus.yml")
    targets = {job["job_name"]: [t for sc in job["static_configs"] for t in sc["targets"]]
               for job in prom["scrape_configs"]}
    assert targets["kvevents-aggregator"] == ["aggregator:8000"]
    assert targets["kvevents-engines"] == [f"{e}:9100" for e in ENGINES]
    for job in targets.values():
        for target in job:
            host, port = target.split(":")
            assert int(port) in _container_ports(compose["services"][host]), target


def test_volumes_mount_files_that_exist(compose):
    services = compose["services"]
    mounts = {}
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            host, container, *mode = vol.split(":")
            assert host.startswith("./"), vol
            assert (ROOT / host).exists(), f"{name} mounts missing {host}"
            assert mode == ["ro"], vol
            mounts[(name, container)] = ROOT / host
    prom_cfg = ROOT / "dashboard/prometheus/prometheus.yml"
    assert mounts[("prometheus", "/etc/prometheus/prometheus.yml")] == prom_cfg
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    provisioning = mounts[("grafana", "/etc/grafana/provisioning")]
    dashboards = mounts[("grafana", "/var/lib/grafana/dashboards")]

    ds = read_yaml(provisioning / "datasources/prometheus.yml")["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    assert ds[0]["url"] == "http://prometheus:9090" and "9090:9090" in services["prometheus"]["ports"]
    providers = read_yaml(provisioning / "dashboards/kvevents.yml")["providers"]
    assert providers[0]["options"]["path"] == "/var/lib/grafana/dashboards"
    dash = json.loads((dashboards / "kvevents.json").read_text())
    var = next(v for v in dash["templating"]["list"] if v["name"] == "datasource")
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert var["current"]["value"] == ds[0]["uid"], "default datasource: the provisioned one"

    env = services["grafana"]["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith("/var/lib/grafana/dashboards/") and (dashboards / Path(home).name).exists()


def test_prometheus_config_is_valid_for_promtool():
    prometheus = require_binary("prometheus")  # promtool ships in the same package
    promtool = shutil.which("promtool") or str(Path(prometheus).with_name("promtool"))
    r = subprocess.run([promtool, "check", "config", str(ROOT / "dashboard/prometheus/prometheus.yml")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr
