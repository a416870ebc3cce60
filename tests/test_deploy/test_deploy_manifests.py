"""Static checks of the Kubernetes manifests in deploy/ (no cluster needed).

They pin what a cluster would only reveal at run time: the model-server command line parses with
our own CLI parser, readiness probes /health and liveness /health/live on the serving port, the
InferencePool selects exactly the model-server pods on that port and points at the endpoint picker's
Service, the endpoint picker is told our metric names (and only ours) and scrapes the metrics port
(which only it and Prometheus may reach), and kustomization.yaml applies every manifest.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from gateway.cli import build_parser, config_from_args
from gateway.http.middleware import LIVENESS_PATH

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUSTOMIZATION = DEPLOY / "kustomization.yaml"

# DESIGN.md "Metrics": the names the endpoint picker reads (vLLM's names with our prefix).
OUR_METRICS = {
    "loraplex:num_requests_waiting",
    "loraplex:num_requests_running",
    "loraplex:kv_cache_usage_perc",
    "loraplex:lora_requests_info",
    "loraplex:cache_config_info",
}
# The GIE v1.0.x endpoint-picker flags that name model-server metrics, and the metric each must name.
EPP_METRIC_FLAGS = {
    "--total-queued-requests-metric": "loraplex:num_requests_waiting",
    "--kv-cache-usage-percentage-metric": "loraplex:kv_cache_usage_perc",
    "--lora-info-metric": "loraplex:lora_requests_info",
}
GIE_POOL_API = "inference.networking.k8s.io/v1"
GIE_OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
EPP_CONFIG_API = "inference.networking.x-k8s.io/v1alpha1"
METRIC_TOKEN = re.compile(r"\b(?:loraplex|vllm|sglang|nv_trt_llm)[A-Za-z_]*:[A-Za-z_:]+")


# ----------------------------------------------------------------------------- loading helpers

def _yaml_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())


def _manifest_files() -> list[Path]:
    return [p for p in _yaml_files() if p != KUSTOMIZATION]


def _docs(path: Path) -> list[dict[str, Any]]:
    with path.open() as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def _objects() -> Iterator[tuple[Path, dict[str, Any]]]:
    for path in _manifest_files():
        for doc in _docs(path):
            yield path, doc


def _find(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for _, d in _objects() if d.get("kind") == kind and (name is None or d["metadata"]["name"] == name)]


def _one(kind: str, name: str | None = None) -> dict[str, Any]:
    found = _find(kind, name)
    assert len(found) == 1, f"expected exactly one {kind} {name or ''}, found {len(found)}"
    return found[0]


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert name in containers, f"{deployment['metadata']['name']} has no container {name!r}"
    return containers[name]


def _model_server() -> tuple[dict[str, Any], dict[str, Any]]:
    dep = _one("Deployment", "loraplex")
    return dep, _container(dep, "loraplex")


def _epp() -> tuple[dict[str, Any], dict[str, Any]]:
    dep = _one("Deployment", "loraplex-epp")
    return dep, _container(dep, "epp")


def _serve_argv(container: dict[str, Any]) -> list[str]:
    """The container's argv after the `loraplex` executable: `serve` then its flags."""
    argv = [*container.get("command", []), *container.get("args", [])]
    assert argv and Path(argv[0]).name == "loraplex", f"the container must run the loraplex console script: {argv[:2]}"
    assert argv[1:2] == ["serve"], f"expected `loraplex serve ...`, got {argv[:3]}"
    return [str(a) for a in argv[1:]]


def _parsed_serve_args(container: dict[str, Any]):
    parser = build_parser()
    argv = _serve_argv(container)
    try:
        return parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits on an unknown flag or a bad value
        pytest.fail(f"`loraplex {' '.join(argv)}` does not parse with gateway.cli.build_parser() (exit {exc.code})")


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag:
            return str(args[i + 1])
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _resolve_port(container: dict[str, Any], port: int | str) -> int:
    if isinstance(port, int):
        return port
    named = {p.get("name"): p["containerPort"] for p in container.get("ports", [])}
    assert port in named, f"port name {port!r} is not a container port of {container['name']}"
    return named[port]


def _epp_plugin_config() -> tuple[dict[str, Any], str]:
    """The EndpointPickerConfig text the EPP reads via --config-file, parsed, and the raw text."""
    dep, epp = _epp()
    config_file = _flag_value(epp["args"], "--config-file")
    assert config_file, "the endpoint picker needs --config-file"
    mount_dir, key = str(Path(config_file).parent), Path(config_file).name
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in epp.get("volumeMounts", [])}
    assert mount_dir in mounts, f"--config-file {config_file} is not under a volume mount of the epp container"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    cm_name = volumes[mounts[mount_dir]]["configMap"]["name"]
    text = _one("ConfigMap", cm_name)["data"][key]
    return yaml.safe_load(text), text


# ----------------------------------------------------------------------------- generic checks

def test_deploy_dir_has_manifests():
    assert KUSTOMIZATION.is_file()
    assert len(_manifest_files()) >= 8


@pytest.mark.parametrize("path", _yaml_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path):
    docs = _docs(path)
    assert docs, f"{path} holds no YAML document"
    assert all(isinstance(d, dict) for d in docs)


@pytest.mark.parametrize("path", _manifest_files(), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_document_is_a_named_object(path: Path):
    for doc in _docs(path):
        assert doc.get("apiVersion"), f"{path}: a document without apiVersion"
        assert doc.get("kind"), f"{path}: a document without kind"
        assert (doc.get("metadata") or {}).get("name"), f"{path}: a {doc.get('kind')} without metadata.name"


def test_kustomization_lists_every_manifest():
    kust = _docs(KUSTOMIZATION)[0]
    assert kust["kind"] == "Kustomization"
    listed = [DEPLOY / r for r in kust["resources"]]
    assert len(listed) == len(set(listed)), "a resource is listed twice"
    for path in listed:
        assert path.is_file(), f"kustomization lists a missing file: {path.name}"
    assert set(listed) == set(_manifest_files()), (
        f"not listed: {sorted(p.name for p in set(_manifest_files()) - set(listed))}")


def test_object_names_are_unique_per_kind():
    seen: set[tuple[str, str]] = set()
    for path, doc in _objects():
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in seen, f"{path.name}: duplicate {key}"
        seen.add(key)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_builds():
    out = subprocess.run(["kubectl", "kustomize", str(DEPLOY)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    built = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(built) == sum(1 for _ in _objects())
    namespaced = [d for d in built if d["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding")]
    assert {d["metadata"].get("namespace") for d in namespaced} == {_docs(KUSTOMIZATION)[0]["namespace"]}


# ----------------------------------------------------------------------------- model server

def test_model_server_args_parse_with_our_cli():
    dep, c = _model_server()
    args = _parsed_serve_args(c)
    port = _resolve_port(c, "http")
    assert args.port == port, "--port must be the container port"
    assert args.host == "0.0.0.0", "the server must listen on all pod addresses, not loopback"
    assert args.device == "cuda"
    assert args.model, "serve a real model, not the embedded demo"
    assert args.lora_modules, "start-up adapters come from --lora-modules"
    assert dep["spec"]["replicas"] >= 2


def test_model_server_adapters_come_from_the_adapters_volume():
    dep, c = _model_server()
    args = _parsed_serve_args(c)
    mounts = {m["mountPath"].rstrip("/"): m for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    for name, path, _base in args.lora_modules:   # (name, path, base_model_name)
        mount = next((m for d, m in mounts.items() if path.startswith(d + "/")), None)
        assert mount is not None, f"adapter {name}={path} is not on a mounted volume"
        assert mount.get("readOnly") is True
        assert "persistentVolumeClaim" in volumes[mount["name"]] or "configMap" in volumes[mount["name"]]
    model_mount = next((m for d, m in mounts.items() if args.model.startswith(d + "/")), None)
    assert model_mount is not None, f"--model {args.model} is not on a mounted volume"


def test_model_server_secrets():
    dep, c = _model_server()
    args = _parsed_serve_args(c)
    # --admin-token is $(VAR), expanded by the kubelet from an env var fed by a Secret
    m = re.fullmatch(r"\$\((\w+)\)", args.admin_token or "")
    assert m, "--admin-token must come from a Secret through $(ENV_VAR), never a literal"
    env = {e["name"]: e for e in c["env"]}
    assert env[m.group(1)]["valueFrom"]["secretKeyRef"]["name"]
    # --tenant-keys is a file on a Secret volume
    assert args.tenant_keys is not None
    mounts = {m["mountPath"].rstrip("/"): m["name"] for m in c["volumeMounts"]}
    mount_dir = str(args.tenant_keys.parent)
    assert mount_dir in mounts, "--tenant-keys must be on a mounted volume"
    volumes = {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}
    secret = volumes[mounts[mount_dir]]["secret"]
    assert args.tenant_keys.name in {i["path"] for i in secret.get("items", [])} or "items" not in secret
    assert args.api_key is None, "a shared --api-key would bypass per-tenant isolation"


def test_model_server_config_builds_with_the_documented_tenant_file(tmp_path: Path):
    """The whole command line passes the CLI's start-up checks, with the tenants.yaml of the docs."""
    doc = (REPO / "docs" / "deployment.md").read_text()
    m = re.search(r"cat > tenants\.yaml <<'EOF'\n(.*?)\nEOF", doc, re.S)
    assert m, "docs/deployment.md shows no tenants.yaml example"
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(m.group(1))
    _, c = _model_server()
    argv = _serve_argv(c)
    argv[argv.index("--tenant-keys") + 1] = str(tenants)
    argv[argv.index("--admin-token") + 1] = "an-admin-token-unlike-any-tenant-key"
    parser = build_parser()
    config = config_from_args(parser.parse_args(argv), parser)
    served = {config.served_model_name, *(name for name, _ in config.engine.lora.lora_modules)}
    documented = {model for t in yaml.safe_load(m.group(1))["tenants"].values() for model in t["models"]}
    assert documented <= served, f"the documented tenants use models the Deployment does not serve: {documented - served}"


def test_model_server_probes_hit_health_on_the_serving_port():
    """Readiness (and start-up) on /health, which fails from SIGTERM on; liveness on /health/live, which
    stays 200 through the drain (a liveness probe on /health would restart a draining pod)."""
    _, c = _model_server()
    port = _parsed_serve_args(c).port
    paths = {"readinessProbe": "/health", "startupProbe": "/health", "livenessProbe": LIVENESS_PATH}
    for probe, path in paths.items():
        assert probe in c, f"missing {probe}"
        get = c[probe]["httpGet"]
        assert get["path"] == path, f"{probe} must probe {path}"
        assert _resolve_port(c, get["port"]) == port


def test_model_server_requests_a_gpu():
    _, c = _model_server()
    res = c["resources"]
    assert int(res["requests"]["nvidia.com/gpu"]) >= 1
    assert res["limits"]["nvidia.com/gpu"] == res["requests"]["nvidia.com/gpu"]


def test_model_server_is_scraped_by_prometheus():
    dep, c = _model_server()
    ann = dep["spec"]["template"]["metadata"]["annotations"]
    assert ann["prometheus.io/scrape"] == "true"
    assert int(ann["prometheus.io/port"]) == _parsed_serve_args(c).metrics_port, "scrape the full metrics port"
    assert ann["prometheus.io/path"] == "/metrics"


def test_metrics_port_is_wired():
    """--tenant-keys makes port 8000's /metrics tenant-blind (no adapter names): the endpoint picker must
    scrape --metrics-port, a declared container port that no Service or route exposes and that the
    NetworkPolicy opens to the picker (and Prometheus) only."""
    dep, c = _model_server()
    args = _parsed_serve_args(c)
    assert args.tenant_keys is not None and args.metrics_port is not None and args.metrics_port != args.port
    assert _resolve_port(c, "metrics") == args.metrics_port
    _, epp = _epp()
    assert int(_flag_value(epp["args"], "--model-server-metrics-port") or 0) == args.metrics_port
    assert _flag_value(epp["args"], "--model-server-metrics-path") in (None, "/metrics")
    (target,) = _one("InferencePool")["spec"]["targetPorts"]
    assert target["number"] == args.port, "requests still go to the serving port"
    for svc in _find("Service"):
        for port in svc["spec"]["ports"]:
            target_port = port.get("targetPort", port["port"])
            if svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items():
                assert _resolve_port(c, target_port) != args.metrics_port, f"Service {svc['metadata']['name']}"
    (policy,) = [p for p in _find("NetworkPolicy")
                 if p["spec"]["podSelector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]
                 ["labels"].items()]
    assert "Ingress" in policy["spec"]["policyTypes"]
    epp_labels = _epp()[0]["spec"]["template"]["metadata"]["labels"]
    for rule in policy["spec"]["ingress"]:
        ports = {p["port"] for p in rule["ports"]}
        if args.metrics_port in ports:
            peers = rule.get("from")
            assert peers, "the metrics port must not be open to every peer"
            assert any(p.get("podSelector", {}).get("matchLabels", {}).items() <= epp_labels.items()
                       and "podSelector" in p for p in peers), "the endpoint picker must reach the metrics port"
    assert any(args.port in {p["port"] for p in rule["ports"]} and not rule.get("from")
               for rule in policy["spec"]["ingress"]), "the API port must stay reachable by the gateway"


def test_model_server_terminates_gracefully():
    dep, c = _model_server()
    spec = dep["spec"]["template"]["spec"]
    grace = spec["terminationGracePeriodSeconds"]
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = getattr(_parsed_serve_args(c), "shutdown_timeout", 0.0)
    assert drain >= 30, "give in-flight generations a real drain window on SIGTERM"
    assert grace > pre_stop + drain, "SIGKILL must not cut the server's own drain short"
    # SIGTERM must reach the server itself: no shell wrapper as PID 1
    assert c["command"][0] not in ("sh", "bash", "/bin/sh", "/bin/bash")


def test_model_server_service_targets_the_serving_port():
    dep, c = _model_server()
    svc = _one("Service", "loraplex")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    (port,) = svc["spec"]["ports"]
    assert _resolve_port(c, port["targetPort"]) == _parsed_serve_args(c).port


# ----------------------------------------------------------------------------- GIE objects

def test_inference_pool_selects_the_model_server_pods_on_their_port():
    pool = _one("InferencePool")
    assert pool["apiVersion"] == GIE_POOL_API
    dep, c = _model_server()
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector and selector.items() <= pod_labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (target,) = pool["spec"]["targetPorts"]
    assert target["number"] == _parsed_serve_args(c).port
    # the endpoint picker's own pods must not join the pool
    epp_dep, _ = _epp()
    assert not selector.items() <= epp_dep["spec"]["template"]["metadata"]["labels"].items()


def test_inference_pool_points_at_the_epp_service():
    pool = _one("InferencePool")
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    svc = _one("Service", ref["name"])
    ports = {p["port"]: p for p in svc["spec"]["ports"]}
    assert ref["port"]["number"] in ports
    epp_dep, epp = _epp()
    assert svc["spec"]["selector"].items() <= epp_dep["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = int(_flag_value(epp["args"], "--grpc-port"))
    assert _resolve_port(epp, ports[ref["port"]["number"]]["targetPort"]) == grpc_port
    assert ref.get("failureMode", "FailClose") in ("FailClose", "FailOpen")


def test_epp_is_told_our_metric_names_and_only_ours():
    _, epp = _epp()
    args = [str(a) for a in epp["args"]]
    for flag, metric in EPP_METRIC_FLAGS.items():
        assert _flag_value(args, flag) == metric, f"{flag} must be {metric}"
    _, config_text = _epp_plugin_config()
    referenced = set(METRIC_TOKEN.findall(" ".join(args) + "\n" + config_text))
    assert referenced, "the endpoint picker references no metric"
    assert referenced <= OUR_METRICS, f"metric names that loraplex does not export: {sorted(referenced - OUR_METRICS)}"


def test_our_metric_names_are_the_ones_the_server_exports():
    source = (REPO / "gateway" / "observability" / "metrics.py").read_text()
    for metric in OUR_METRICS:
        assert f'"{metric}"' in source, f"gateway/observability/metrics.py no longer exports {metric}"
    for label in ("max_lora", "running_lora_adapters", "waiting_lora_adapters", "block_size", "num_gpu_blocks"):
        assert f'"{label}"' in source


def test_epp_pool_and_scoring_config():
    _, epp = _epp()
    pool = _one("InferencePool")
    assert _flag_value(epp["args"], "--pool-name") == pool["metadata"]["name"]
    config, _ = _epp_plugin_config()
    assert config["apiVersion"] == EPP_CONFIG_API and config["kind"] == "EndpointPickerConfig"
    plugins = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    (profile,) = config["schedulingProfiles"]
    used = {plugins[ref["pluginRef"]]: ref.get("weight", 1) for ref in profile["plugins"]}
    for scorer in ("lora-affinity-scorer", "queue-scorer", "kv-cache-utilization-scorer"):
        assert used.get(scorer, 0) > 0, f"{scorer} is not active in the scheduling profile"
    assert "max-score-picker" in used
    for probe in ("livenessProbe", "readinessProbe"):
        assert epp[probe]["grpc"]["port"] == int(_flag_value(epp["args"], "--grpc-health-port"))


def test_epp_rbac_covers_what_it_watches():
    epp_dep, _ = _epp()
    sa = epp_dep["spec"]["template"]["spec"]["serviceAccountName"]
    _one("ServiceAccount", sa)
    binding = next(b for b in _find("RoleBinding") if any(s["name"] == sa for s in b["subjects"]))
    role = _one("Role", binding["roleRef"]["name"])
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               if {"get", "list", "watch"} <= set(rule["verbs"])}
    assert {("inference.networking.k8s.io", "inferencepools"),
            ("inference.networking.x-k8s.io", "inferenceobjectives"), ("", "pods")} <= granted


def test_httproute_sends_inference_to_the_pool():
    route = _one("HTTPRoute")
    pool = _one("InferencePool")
    assert route["spec"]["parentRefs"]
    pool_rules = [r for r in route["spec"]["rules"]
                  if any(b.get("kind") == "InferencePool" for b in r["backendRefs"])]
    assert pool_rules
    paths = set()
    for rule in pool_rules:
        for ref in rule["backendRefs"]:
            assert ref["group"] == "inference.networking.k8s.io" and ref["name"] == pool["metadata"]["name"]
        paths |= {m["path"]["value"] for m in rule["matches"]}
    assert {"/v1/completions", "/v1/chat/completions"} <= paths
    # the admin API and /metrics are never exposed through the gateway
    all_paths = {m["path"]["value"] for r in route["spec"]["rules"] for m in r["matches"]}
    assert all(p.startswith("/v1/") and "lora_adapter" not in p for p in all_paths)


def test_inference_objectives_reference_the_pool():
    objectives = _find("InferenceObjective")
    assert objectives
    pool = _one("InferencePool")
    for obj in objectives:
        assert obj["apiVersion"] == GIE_OBJECTIVE_API
        ref = obj["spec"]["poolRef"]
        assert ref["name"] == pool["metadata"]["name"]
        assert ref.get("group", "inference.networking.k8s.io") == "inference.networking.k8s.io"
        assert isinstance(obj["spec"]["priority"], int)


def test_deployment_doc_covers_the_contract():
    doc = (REPO / "docs" / "deployment.md").read_text()
    for metric in OUR_METRICS:
        assert metric in doc
    for needle in ("v1.0.1", "/v1/load_lora_adapter", "lora-affinity-scorer", "kubectl apply -k deploy/"):
        assert needle in doc
