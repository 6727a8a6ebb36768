"""deploy/kubernetes/: two aggregator replicas with engine discovery, checked offline.

No cluster runs on the CI machines, so the manifests are checked without one:

* every object of the base (``kubectl apply -k deploy/kubernetes``: pod-watch discovery
  with RBAC) and of the rendered DNS overlay (``deploy/kubernetes/overlays/dns``:
  headless-Service discovery, no RBAC) is validated against Kubernetes' own JSON
  schemas (the ``kubernetes-validate`` package bundles them), strictly: an unknown or
  misspelt field fails;
* the overlay is rendered here, in Python, by :func:`render`, a small implementation of
  exactly the kustomize features these files use (so the tests need no kustomize
  binary). Where ``kubectl`` is installed, ``kubectl kustomize`` renders both too and
  must agree with :func:`render` object for object;
* the objects agree with each other: selectors and labels, the Role (get/list/watch on
  pods, nothing more) and its binding to the ServiceAccount, the PodDisruptionBudget,
  probes on /readyz and /healthz, the headless Service against the discovery flags;
* the container's args are a valid ``kvevents serve`` command line: the real CLI
  parses them and builds its settings from them.
"""

from __future__ import annotations

import copy
import importlib
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate not installed (the dev extra has it)")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
BASE = K8S / "base"
DNS = K8S / "overlays" / "dns"
ENGINES = K8S / "engines"
MONITORING = K8S / "monitoring"

# The Kubernetes versions whose schemas every object must pass: an older release still
# widely run, and the newest that kubernetes-validate (>=1.37, the dev extra) bundles.
SCHEMA_VERSIONS = ("1.30", "1.37")

APP = {"app.kubernetes.io/name": "kvevents-aggregator"}
POD_NAMESPACE = "inference"  # what the downward API would give, for $(POD_NAMESPACE)


# --- kustomize, the part of it these files use --------------------------------------------

#: Keys of a kustomization this renderer implements; anything else is refused, so it
#: never silently renders something kustomize would render differently.
_KUSTOMIZATION_KEYS = {"apiVersion", "kind", "resources", "labels", "patches", "images"}
#: Strategic merge: lists of objects merged by a key (the Kubernetes API's
#: patchMergeKey), and lists replaced whole (no patch strategy). Only the lists these
#: patches touch; any other list is refused.
_MERGE_KEYS = {"containers": "name"}
_REPLACED_LISTS = {"args"}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _id(obj: dict) -> tuple[str, str, str]:
    return obj["apiVersion"], obj["kind"], obj["metadata"]["name"]


def _strategic_merge(base, patch, key: str = ""):
    """Kubernetes' strategic merge patch, the subset above: maps merge key by key (a null
    value deletes the key), ``containers`` merge by name, ``args`` are replaced whole."""
    if isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise NotImplementedError(f"strategic-merge directive inside {key!r}")
        out = dict(base) if isinstance(base, dict) else {}
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            else:
                out[k] = _strategic_merge(out.get(k), v, k)
        return out
    if isinstance(patch, list):
        if key in _REPLACED_LISTS:
            return list(patch)
        if key in _MERGE_KEYS:
            mk = _MERGE_KEYS[key]
            out = list(base or [])
            for item in patch:
                at = next((i for i, x in enumerate(out) if x[mk] == item[mk]), None)
                if at is None:
                    out.append(item)
                else:
                    out[at] = _strategic_merge(out[at], item)
            return out
        raise NotImplementedError(f"strategic merge of the list {key!r}")
    return patch


def render(root: Path) -> list[dict]:
    """``kustomize build ROOT`` for: ``resources`` (files, and directories holding a
    kustomization), ``patches`` given by ``path`` (strategic merge, matched by
    apiVersion/kind/name; ``$patch: delete`` removes the object) and ``labels`` with
    ``pairs`` only (added to ``metadata.labels``, not to selectors or templates), and
    ``images`` (``name`` with ``newName`` and/or ``newTag``: the image of every container
    and initContainer named ``name``, with or without a tag, rewritten). Patches are
    applied before labels and images, in kustomize's order. Anything else raises."""
    kust = yaml.safe_load((root / "kustomization.yaml").read_text())
    if set(kust) - _KUSTOMIZATION_KEYS:
        raise NotImplementedError(f"{root}: {sorted(set(kust) - _KUSTOMIZATION_KEYS)}")
    objects: list[dict] = []
    for entry in kust.get("resources", []):
        path = root / entry
        objects += render(path) if path.is_dir() else copy.deepcopy(_docs(path))
    ids = [_id(o) for o in objects]
    assert len(ids) == len(set(ids)), f"{root}: duplicate objects {ids}"
    for entry in kust.get("patches", []):
        if set(entry) != {"path"}:
            raise NotImplementedError(f"{root}: patch {entry}")
        for patch in _docs(root / entry["path"]):
            at = [i for i, o in enumerate(objects) if _id(o) == _id(patch)]
            assert len(at) == 1, f"{root}: patch {_id(patch)} matches {len(at)} objects"
            if patch.get("$patch") == "delete":
                del objects[at[0]]
            else:
                objects[at[0]] = _strategic_merge(objects[at[0]], patch)
    for entry in kust.get("labels", []):
        if set(entry) != {"pairs"}:  # includeSelectors / includeTemplates: not implemented
            raise NotImplementedError(f"{root}: labels {entry}")
        for obj in objects:
            obj["metadata"].setdefault("labels", {}).update(entry["pairs"])
    for entry in kust.get("images", []):
        if not set(entry) <= {"name", "newName", "newTag"}:  # digest: not implemented
            raise NotImplementedError(f"{root}: images {entry}")
        for obj in objects:
            pod = obj.get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                name, _, tag = c["image"].partition(":")
                if name == entry["name"]:
                    name = entry.get("newName", name)
                    tag = entry.get("newTag", tag)
                    c["image"] = f"{name}:{tag}" if tag else name
    return objects


RENDERED = {"base": render(K8S), "dns": render(DNS), "engines": render(ENGINES),
            "monitoring": render(MONITORING)}
#: The variants that kubernetes-validate checks (the monitoring objects are the
#: Prometheus operator's custom resources: no schema there; checked field by field below).
CORE = ("base", "dns", "engines")


def _one(variant: str, kind: str) -> dict:
    (obj,) = [o for o in RENDERED[variant] if o["kind"] == kind]
    return obj


def _pod(variant: str) -> dict:
    return _one(variant, "Deployment")["spec"]["template"]


def _container(variant: str) -> dict:
    (container,) = _pod(variant)["spec"]["containers"]
    return container


def _flags(args: list[str]) -> dict[str, str]:
    out = {}
    for arg in args[2:]:
        name, eq, value = arg.partition("=")
        assert name.startswith("--") and eq, f"one --flag=value per item: {arg!r}"
        assert name not in out, f"{name} twice"
        out[name] = value
    return out


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of container args from the container's env."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def _env(container: dict) -> dict[str, str]:
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "fieldRef" in e["valueFrom"]:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
            env[e["name"]] = POD_NAMESPACE
        # secretKeyRef: a Secret's value, which no arg refers to
    return env


# --- the files ----------------------------------------------------------------------------

def test_every_file_is_used():
    def used(root: Path) -> set[str]:
        kust = yaml.safe_load((root / "kustomization.yaml").read_text())
        files = {"kustomization.yaml"} | {p["path"] for p in kust.get("patches", [])}
        return files | {r for r in kust.get("resources", []) if (root / r).is_file()}

    for root in (BASE, DNS, ENGINES, MONITORING):
        assert {p.name for p in root.iterdir()} == used(root), root
    assert {p.name for p in K8S.iterdir()} == {"kustomization.yaml", "README.md", "base",
                                               "overlays", "engines", "monitoring"}
    assert yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"] == ["base"]
    assert yaml.safe_load((DNS / "kustomization.yaml").read_text())["resources"][0] == "../../base"
    readme = (K8S / "README.md").read_text()
    assert "kubectl apply -k deploy/kubernetes " in readme
    assert "kubectl apply -k deploy/kubernetes/overlays/dns " in readme
    assert "kubectl apply -k deploy/kubernetes/engines " in readme
    assert "kubectl apply -k deploy/kubernetes/monitoring " in readme


def test_rendered_objects():
    kinds = lambda v: sorted(o["kind"] for o in RENDERED[v])  # noqa: E731
    assert kinds("base") == ["Deployment", "PodDisruptionBudget", "Role", "RoleBinding",
                             "Service", "ServiceAccount"]
    assert kinds("dns") == ["Deployment", "PodDisruptionBudget", "Service", "Service",
                            "ServiceAccount"]
    for obj in RENDERED["base"]:  # the base's labels transformer reached every object
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kvevents", _id(obj)


@pytest.mark.parametrize("variant", list(RENDERED))
def test_kubectl_kustomize_agrees_with_render(variant):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed (render() and the schema checks still run)")
    path = {"base": K8S, "dns": DNS, "engines": ENGINES, "monitoring": MONITORING}[variant]
    r = subprocess.run([kubectl, "kustomize", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    theirs = {_id(d): d for d in yaml.safe_load_all(r.stdout) if d}
    ours = {_id(d): d for d in RENDERED[variant]}
    assert theirs.keys() == ours.keys()
    for key in ours:
        assert theirs[key] == ours[key], key


# --- Kubernetes' schemas ------------------------------------------------------------------

@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("variant,obj", [
    pytest.param(v, o, id=f"{v}-{o['kind']}-{o['metadata']['name']}")
    for v, objs in RENDERED.items() if v in CORE for o in objs
])
def test_valid_against_the_kubernetes_schema(variant, obj, version):
    assert kubernetes_validate.validate(obj, version, strict=True) == version


def test_the_schema_check_catches_mistakes():
    """Strict validation is not vacuous: a misspelt field, a wrong type, a missing
    required field each fail."""
    dep = _one("base", "Deployment")
    for mutate in (
        lambda d: d["spec"].__setitem__("replica", 2),  # misspelt
        lambda d: d["spec"].__setitem__("replicas", "two"),
        lambda d: d["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]
        .pop("port"),
    ):
        bad = copy.deepcopy(dep)
        mutate(bad)
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(bad, SCHEMA_VERSIONS[-1], strict=True)
    role = copy.deepcopy(_one("base", "Role"))
    role["rules"][0]["verb"] = role["rules"][0].pop("verbs")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(role, SCHEMA_VERSIONS[-1], strict=True)


# --- the objects agree --------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["base", "dns"])
def test_replicas_rollout_selectors_and_service(variant):
    dep, pod = _one(variant, "Deployment"), _pod(variant)
    labels = pod["metadata"]["labels"]
    assert labels.items() >= APP.items()
    assert dep["spec"]["replicas"] == 2
    assert dep["spec"]["strategy"] == {
        "type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}}
    assert dep["spec"]["selector"] == {"matchLabels": APP}

    (svc,) = [s for s in RENDERED[variant] if s["kind"] == "Service"
              and s["metadata"]["name"] == "kvevents-aggregator"]
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["selector"] == APP
    ports = {p["name"]: p["containerPort"] for p in _container(variant)["ports"]}
    assert ports == {"http": 8090}
    (sport,) = svc["spec"]["ports"]
    assert sport == {"name": "http", "port": 8090, "targetPort": "http"}

    anti = pod["spec"]["affinity"]["podAntiAffinity"]
    (term,) = anti["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"] == {"matchLabels": APP}
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in anti  # one node: both run

    pdb = _one(variant, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and pdb["spec"]["selector"] == {"matchLabels": APP}
    assert "maxUnavailable" not in pdb["spec"]


@pytest.mark.parametrize("variant", ["base", "dns"])
def test_probes_scrape_annotations_and_security(variant):
    container, pod = _container(variant), _pod(variant)
    assert container["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert notes["prometheus.io/port"] == "8090"
    svc = next(o for o in RENDERED[variant] if _id(o) == ("v1", "Service", "kvevents-aggregator"))
    assert "prometheus.io/scrape" not in svc["metadata"].get("annotations", {})  # scraped once
    assert container["image"].startswith("kvevents-aggregator:")  # the torch-free image
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    for c in [container, *pod["spec"]["initContainers"]]:
        assert c["securityContext"]["readOnlyRootFilesystem"] is True, c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
    # No ConfigMap (the settings are the args): the one volume is the tokenizer's.
    assert pod["spec"]["volumes"] == [{"name": "tokenizers", "emptyDir": {"sizeLimit": "256Mi"}}]


def test_base_rbac_is_get_list_watch_on_pods_for_the_aggregator_only():
    sa, role, binding = (_one("base", k) for k in ("ServiceAccount", "Role", "RoleBinding"))
    pod = _pod("base")["spec"]
    assert pod["serviceAccountName"] == sa["metadata"]["name"]
    assert sa["automountServiceAccountToken"] is False  # opt-in per pod
    assert pod["automountServiceAccountToken"] is True  # the pod watch needs the token
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"],
                              "verbs": ["get", "list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"]}]
    assert not [o for o in RENDERED["base"] if o["kind"].startswith("Cluster")]


def test_base_discovers_pods_by_label():
    flags = _flags(_container("base")["args"])
    assert flags["--discover-k8s-selector"] == "app.kubernetes.io/name=vllm"
    assert flags["--discover-k8s-namespace"] == "$(POD_NAMESPACE)"
    assert "--discover-dns" not in flags
    (env,) = [e for e in _container("base")["env"] if e["name"] == "POD_NAMESPACE"]
    assert env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}


def test_dns_overlay_needs_no_rbac_and_changes_only_discovery():
    assert not [o for o in RENDERED["dns"] if o["kind"] in ("Role", "RoleBinding")]
    assert _pod("dns")["spec"]["automountServiceAccountToken"] is False
    assert _pod("dns")["spec"]["serviceAccountName"] == _pod("base")["spec"]["serviceAccountName"]

    base, dns = _flags(_container("base")["args"]), _flags(_container("dns")["args"])
    assert {k for k in dns if k not in base} == {"--discover-dns", "--discover-interval"}
    assert {k for k in base if k not in dns} == {"--discover-k8s-selector",
                                                 "--discover-k8s-namespace"}
    shared = base.keys() & dns.keys()
    assert {k: dns[k] for k in shared} == {k: base[k] for k in shared}

    # Besides the args and the token, the Deployment and every other base object are
    # the base's.
    unset = {"automountServiceAccountToken": None,
             "containers": [{"name": "aggregator", "args": []}]}
    strip = lambda d: _strategic_merge(d, {"spec": {"template": {"spec": unset}}})  # noqa: E731
    assert strip(_one("dns", "Deployment")) == strip(_one("base", "Deployment"))
    for obj in RENDERED["base"]:
        if obj["kind"] not in ("Role", "RoleBinding", "Deployment"):
            assert obj in RENDERED["dns"], _id(obj)


def test_dns_overlay_headless_service_is_the_name_resolved():
    (headless,) = [o for o in RENDERED["dns"] if _id(o) == ("v1", "Service", "vllm-headless")]
    spec = headless["spec"]
    assert spec["clusterIP"] == "None" and spec["publishNotReadyAddresses"] is False
    flags = _flags(_container("dns")["args"])
    # The Service selects the pods the base's pod watch follows.
    base_selector = _flags(_container("base")["args"])["--discover-k8s-selector"]
    assert spec["selector"] == dict([base_selector.split("=")])
    name = _expand(flags["--discover-dns"], _env(_container("dns")))
    assert name == f"{headless['metadata']['name']}.{POD_NAMESPACE}.svc.cluster.local"
    assert {p["port"] for p in spec["ports"]} == {
        int(flags[f"--discover-{k}-port"]) for k in ("events", "replay", "http")}


@pytest.mark.parametrize("variant", ["base", "dns"])
def test_args_are_a_valid_kvevents_serve_command(variant, capsys, monkeypatch):
    """The args, $(VAR)s expanded as the kubelet does, go through the real CLI: its
    parser, then its settings (everything ``kvevents serve`` checks before it starts
    the server, which is replaced here)."""
    cli = importlib.import_module("kvevents.cli.main")  # kvevents.cli.main is also a function

    container = _container(variant)
    env = _env(container)
    args = [_expand(a, env) for a in container["args"]]
    assert not [a for a in args if "$(" in a], "every $(VAR) is in the container's env"
    assert args[:2] == ["kvevents", "serve"]  # the image has no ENTRYPOINT: args are the command

    try:
        ns = cli.build_parser().parse_args(args[1:])
    except SystemExit:
        pytest.fail(capsys.readouterr().err)
    for name in [n for n in os.environ if n.startswith("KVEVENTS_")]:
        monkeypatch.delenv(name)  # only the args count
    started = []
    monkeypatch.setattr("kvevents.cli.serve.run_server", lambda s: started.append(s) or 0)
    assert cli._serve(ns) == 0, capsys.readouterr().err
    (s,) = started

    assert s.host == "0.0.0.0" and s.port == container["ports"][0]["containerPort"]
    assert s.bootstrap_from == "http://kvevents-aggregator:8090"  # the Service: ready replicas
    ports = (s.discover_events_port, s.discover_replay_port, s.discover_http_port)
    assert ports == (5557, 5558, 8000)
    assert s.discover_model and s.discover_grace_s > 0 and not s.engines
    if variant == "base":
        assert s.discover_k8s_selector == "app.kubernetes.io/name=vllm"
        assert s.discover_k8s_namespace == POD_NAMESPACE and not s.discover_dns
    else:
        assert s.discover_dns == (f"vllm-headless.{POD_NAMESPACE}.svc.cluster.local",)
        assert s.discover_k8s_selector is None and s.discover_interval_s == 5


def test_the_aggregator_image_has_the_k8s_and_text_extras():
    dockerfile = (ROOT / "Dockerfile").read_text()
    agg = dockerfile.split(" AS aggregator\n", 1)[1]
    assert re.search(r'^RUN pip install "\$\(echo /wheels/kvevents-\*\.whl\)\[k8s,text\]"', agg, re.M)
    assert "torch" not in agg
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(req.startswith("lightkube") for req in extras["k8s"])
    assert any(req.startswith("tokenizers") for req in extras["text"])


# --- the production path: image, engines, tokens, tokenizer, scraping ----------------------

def test_the_image_tag_is_the_package_version_in_one_place():
    import kvevents

    kust = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert kust["images"] == [{"name": "kvevents-aggregator", "newTag": kvevents.__version__}]
    raw = yaml.safe_load((BASE / "deployment.yaml").read_text())["spec"]["template"]["spec"]
    # The manifest itself names no tag: the version is written in the kustomization only.
    assert {c["image"] for c in raw["containers"] + raw["initContainers"]} == {"kvevents-aggregator"}
    for variant in ("base", "dns"):
        pod = _pod(variant)["spec"]
        for c in pod["containers"] + pod["initContainers"]:
            assert c["image"] == f"kvevents-aggregator:{kvevents.__version__}", (variant, c["name"])
    # The README's override and build commands use the same names.
    readme = (K8S / "README.md").read_text()
    assert "newName: REGISTRY/kvevents-aggregator" in readme
    assert "docker build --target aggregator -t REGISTRY/kvevents-aggregator:$VERSION ." in readme


def test_an_images_override_in_an_overlay_reaches_every_container(tmp_path):
    """The README's overlay (images: newName/newTag over the base) renders with the
    registry's image in the aggregator and its initContainer, by render() and, where
    installed, by kubectl kustomize."""
    (tmp_path / "kustomization.yaml").write_text(
        f"apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        f"resources:\n  - {os.path.relpath(BASE, tmp_path)}\n"
        f"images:\n  - name: kvevents-aggregator\n    newName: registry.example.com/kvevents-aggregator\n"
        f"    newTag: 0.2.0-rc1\n")
    objs = render(tmp_path)
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert {c["image"] for c in pod["containers"] + pod["initContainers"]} == {
        "registry.example.com/kvevents-aggregator:0.2.0-rc1"}
    kubectl = shutil.which("kubectl")
    if kubectl:
        r = subprocess.run([kubectl, "kustomize", str(tmp_path)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stderr
        theirs = {_id(d): d for d in yaml.safe_load_all(r.stdout) if d}
        assert theirs == {_id(d): d for d in objs}


def _engine_container() -> dict:
    dep = _one("engines", "Deployment")
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("variant", ["base", "dns"])
def test_the_engines_serve_the_model_the_aggregator_discovers(variant):
    """engines/vllm.yaml against the aggregator's discovery flags: the label the pod
    watch selects, the served model name, and the ports of the events, the replay socket
    and the OpenAI server."""
    import json

    dep, c = _one("engines", "Deployment"), _engine_container()
    labels = dep["spec"]["template"]["metadata"]["labels"]
    flags = _flags(_container(variant)["args"])
    selector = _flags(_container("base")["args"])["--discover-k8s-selector"]
    assert labels.items() >= dict([selector.split("=")]).items()
    if variant == "dns":
        (headless,) = [o for o in RENDERED["dns"] if _id(o) == ("v1", "Service", "vllm-headless")]
        assert headless["spec"]["selector"].items() <= labels.items()

    assert c["command"] == ["vllm", "serve"]
    args = c["args"]
    model, options = args[0], args[1:]
    assert not model.startswith("--") and "/" in model  # the Hugging Face repository
    opts = dict(a.split("=", 1) if "=" in a else (a, "") for a in options)
    assert opts["--served-model-name"] == flags["--discover-model"]
    # The tokenizer the aggregator fetches is this model's, under the served name.
    (init,) = _pod(variant)["spec"]["initContainers"]
    init_env = {e["name"]: e.get("value") for e in init["env"]}
    assert init_env["HF_MODEL"] == model
    name, _, path = flags["--tokenizer"].partition("=")
    assert name == opts["--served-model-name"] and path == init_env["TOKENIZER_DIR"]

    events = json.loads(opts["--kv-events-config"])
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    port = lambda ep: int(ep.rsplit(":", 1)[1])  # noqa: E731
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port(events["endpoint"]) == ports["kv-events"] == int(flags["--discover-events-port"])
    assert port(events["replay_endpoint"]) == ports["kv-replay"] == int(flags["--discover-replay-port"])
    assert int(opts["--port"]) == ports["http"] == int(flags["--discover-http-port"])
    assert "--enable-prefix-caching" in opts and "--enable-prompt-tokens-details" in opts
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}


@pytest.mark.parametrize("variant", ["base", "dns"])
def test_tokens_come_from_a_secret_and_reach_the_settings(variant, monkeypatch):
    """--api-key and --auth-token as KVEVENTS_API_KEY / KVEVENTS_AUTH_TOKEN from the
    Secret kvevents-tokens; the settings loader reads exactly those names."""
    from kvevents.service.settings import load_settings

    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in _container(variant)["env"]
           if "secretKeyRef" in e.get("valueFrom", {})}
    assert env == {"KVEVENTS_API_KEY": {"name": "kvevents-tokens", "key": "api-key"},
                   "KVEVENTS_AUTH_TOKEN": {"name": "kvevents-tokens", "key": "auth-token"}}
    for name in [n for n in os.environ if n.startswith("KVEVENTS_")]:
        monkeypatch.delenv(name)
    s = load_settings(env={"KVEVENTS_API_KEY": "k1", "KVEVENTS_AUTH_TOKEN": "t1"})
    assert (s.api_key, s.auth_token) == ("k1", "t1")
    readme = (K8S / "README.md").read_text()
    assert "kubectl create secret generic kvevents-tokens" in readme
    assert "--from-literal=api-key=" in readme and "--from-literal=auth-token=" in readme


def test_the_tokenizer_init_container_fetches_a_loadable_tokenizer(tmp_path):
    """The initContainer's script, run as the kubelet would run it, against a local HTTP
    server laid out as the Hugging Face Hub (HF_ENDPOINT): the directory it writes is
    one the aggregator's --tokenizer loads, and a missing required file fails it."""
    import http.server
    import sys
    import threading

    from text_tokenizer import build_bytelevel, require_transformers

    require_transformers()
    repo = tmp_path / "hub" / "org" / "model" / "resolve" / "main"
    repo.mkdir(parents=True)
    build_bytelevel(repo)

    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path / "hub"))  # noqa: E731
    http.server.SimpleHTTPRequestHandler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (init,) = _pod("base")["spec"]["initContainers"]
        assert init["command"] == ["python", "-c"]
        out = tmp_path / "tokenizers" / "m"
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}",
               "HF_MODEL": "org/model", "TOKENIZER_DIR": str(out)}
        r = subprocess.run([sys.executable, "-c", init["args"][0]], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert (out / "tokenizer.json").read_bytes() == (repo / "tokenizer.json").read_bytes()
        from kvevents.text.tokenizer import TextTokenizer

        assert TextTokenizer("m", out).encode_prompt("hello world")

        (repo / "tokenizer_config.json").unlink()
        r = subprocess.run([sys.executable, "-c", init["args"][0]],
                           env={**env, "TOKENIZER_DIR": str(tmp_path / "again")},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "tokenizer_config.json" in r.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_pod_monitors_scrape_the_aggregator_and_the_engines():
    monitors = {o["metadata"]["name"]: o for o in RENDERED["monitoring"] if o["kind"] == "PodMonitor"}
    assert set(monitors) == {"kvevents-aggregator", "vllm"}
    targets = {"kvevents-aggregator": (_pod("base"), _container("base")),
               "vllm": (_one("engines", "Deployment")["spec"]["template"], _engine_container())}
    for name, mon in monitors.items():
        assert mon["apiVersion"] == "monitoring.coreos.com/v1"
        pod, container = targets[name]
        assert mon["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        (ep,) = mon["spec"]["podMetricsEndpoints"]
        assert ep["path"] == "/metrics"
        assert ep["port"] in {p["name"] for p in container["ports"]}, name
    kinds = sorted(o["kind"] for o in RENDERED["monitoring"])
    assert kinds == ["PodMonitor", "PodMonitor", "PrometheusRule"]
