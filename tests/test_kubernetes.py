"""deploy/kubernetes/ hangs together: the aggregator's Deployment, Service and config.

No cluster in CI, so the manifests are checked structurally: they parse, the kustomization
lists them, selectors match the pod labels, ports, probes and scrape annotations agree
with the port the config file sets, and the config file is read by the aggregator's own
settings loader. Where kubectl is installed, ``kubectl kustomize`` renders them too.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvevents.service.settings import load_settings

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    out = {}
    for name in kust["resources"]:
        for doc in yaml.safe_load_all((K8S / name).read_text()):
            assert {"apiVersion", "kind", "metadata"} <= set(doc), name
            out[doc["kind"]] = doc
    return out


def test_kustomization_lists_every_file():
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    generated = [f for gen in kust["configMapGenerator"] for f in gen["files"]]
    on_disk = {p.name for p in K8S.iterdir()} - {"kustomization.yaml"}
    assert set(kust["resources"]) | set(generated) == on_disk


def test_config_file_is_read_by_the_real_settings_loader(objects):
    settings = load_settings(str(K8S / "kvevents.toml"), env={})
    assert settings.host == "0.0.0.0" and settings.engines, "listens beyond the pod, follows engines"
    assert all(p.replay_endpoint for p in settings.engines)
    container = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert [p["containerPort"] for p in container["ports"] if p["name"] == "http"] == [settings.port]


def test_selectors_ports_probes_and_scrape_annotations(objects):
    dep, svc = objects["Deployment"], objects["Service"]
    template = dep["spec"]["template"]
    labels = template["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"

    container = template["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("readinessProbe", "livenessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthz" and get["port"] in ports, probe
    (sport,) = svc["spec"]["ports"]
    assert sport["targetPort"] in ports and sport["port"] == ports[sport["targetPort"]]

    notes = template["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == ports["http"]
    assert "prometheus.io/scrape" not in svc["metadata"].get("annotations", {})  # scraped once


def test_config_mount_and_image(objects):
    spec = objects["Deployment"]["spec"]["template"]["spec"]
    container = spec["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    (mount,) = container["volumeMounts"]
    (volume,) = spec["volumes"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert env["KVEVENTS_CONFIG"] == f"{mount['mountPath']}/kvevents.toml"
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert volume["configMap"]["name"] == kust["configMapGenerator"][0]["name"]
    assert container["image"].startswith("kvevents-aggregator:")  # the torch-free image
    assert container["args"] == ["kvevents", "serve"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_kubectl_kustomize_renders_them():
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (optional: the structural checks above still run)")
    r = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    docs = list(yaml.safe_load_all(r.stdout))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == ["ConfigMap", "Deployment", "Service"]
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    dep = next(d for d in docs if d["kind"] == "Deployment")
    # The generated name (with its content hash) is the one the Deployment mounts.
    assert dep["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert cm["data"]["kvevents.toml"] == (K8S / "kvevents.toml").read_text()
