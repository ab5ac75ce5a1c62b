"""The compose stack for real (scripts/stack.sh: the CPU image, two replicas, nginx, Prometheus, Alertmanager on podman
+ docker-compose 1.29): load and the HTTP/JSON API through nginx, both replicas scraped and healthy, an alert delivered
to the receiver, rolling restarts and a scale-up under load without a failed call, and nothing left running after
`down`; and the containers.conf that scripts/stack.sh writes, on files (no podman needed).

The stack runs as its own compose project with its own state dir and free ports, so a stack already up (the default
project of `make stack` included) is left alone. Runs where podman is installed (scripts/stack.sh installs the
rest); skipped where podman's own probe finds that no container can run on the machine, with podman's error as the
reason. NMT_CONTAINER_TESTS=0 skips it, NMT_CONTAINER_TESTS=1 fails it instead of skipping. From a machine with no
images it builds them first (minutes). NMT_STACK_RESTARTS sets the rolling restarts (default 1)."""

from __future__ import annotations

import dataclasses
import datetime
import itertools
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from nmt_serve.bench.balancer import free_port
from tests.serving import wait_for
from tests.test_rolling_restart import Load

ROOT = Path(__file__).resolve().parent.parent
STACK = ROOT / "scripts" / "stack.sh"
# Never the default project ("nmt"): the tests start and end this project's containers only.
PROJECT = "nmt-stack-test"
CANNOT_RUN = 3  # scripts/stack.sh's exit status where podman's probe container does not run
logger = logging.getLogger(__name__)


def skip_reason() -> str | None:
    required = os.environ.get("NMT_CONTAINER_TESTS")
    if required == "0":
        return "container tests switched off (NMT_CONTAINER_TESTS=0)"
    if required == "1":
        return None
    if shutil.which("podman") is None:
        return "podman not installed (scripts/stack.sh up installs it and the rest; then run pytest -m container)"
    if os.geteuid() != 0:
        return "scripts/stack.sh runs rootful podman: run as root"
    return None


needs_containers = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


@dataclasses.dataclass
class Stack:
    """The test's own stack: where it keeps its state and publishes its ports, and what the tests measured."""

    state: Path
    balancer: str  # host:port, gRPC
    balancer_http: str  # base URL of the HTTP/JSON API
    prometheus: str  # base URL
    env: dict[str, str]  # for scripts/stack.sh and docker-compose
    timings: dict[str, float] = dataclasses.field(default_factory=dict)


# The test's alerting: the shipped rules and routes with every wait short, so that an alert reaches the receiver
# within seconds of its cause (compose's NMT_ALERT_RULES and NMT_ALERTMANAGER_CONFIG).
ALERT_FOR = "5s"
ROUTE_WAITS = {"group_wait": "1s", "group_interval": "5s"}


def write_short_alerting(state: Path) -> dict[str, str]:
    """deploy/alerts.yml with every `for:` ALERT_FOR and deploy/alertmanager.yml with ROUTE_WAITS, in `state`."""
    rules = yaml.safe_load((ROOT / "deploy" / "alerts.yml").read_text(encoding="utf-8"))
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule["for"] = ALERT_FOR
    routes = yaml.safe_load((ROOT / "deploy" / "alertmanager.yml").read_text(encoding="utf-8"))
    routes["route"] |= ROUTE_WAITS
    (state / "alerts.yml").write_text(yaml.safe_dump(rules), encoding="utf-8")
    (state / "alertmanager.yml").write_text(yaml.safe_dump(routes), encoding="utf-8")
    return {"NMT_ALERT_RULES": str(state / "alerts.yml"), "NMT_ALERTMANAGER_CONFIG": str(state / "alertmanager.yml")}


def new_stack(state: Path) -> Stack:
    balancer_port, balancer_http_port, prometheus_port = free_port(), free_port(), free_port()
    env = os.environ | write_short_alerting(state) | {
        "NMT_STACK_PROJECT": PROJECT, "COMPOSE_PROJECT_NAME": PROJECT, "NMT_STACK_DIR": str(state), "NMT_BIND": "127.0.0.1",
        "NMT_BALANCER_PORT": str(balancer_port), "NMT_BALANCER_HTTP_PORT": str(balancer_http_port), "NMT_PROMETHEUS_PORT": str(prometheus_port),
        "NMT_ALERTMANAGER_PORT": str(free_port()),
        "DOCKER_HOST": f"unix://{state / 'podman.sock'}",
        "GRAFANA_ADMIN_PASSWORD": os.environ.get("GRAFANA_ADMIN_PASSWORD", "unused-grafana-not-started"),
    }  # fmt: skip
    return Stack(state, f"127.0.0.1:{balancer_port}", f"http://127.0.0.1:{balancer_http_port}", f"http://127.0.0.1:{prometheus_port}", env)


def stack_script(stack: Stack, command: str, timeout: float = 1800, **kwargs) -> subprocess.CompletedProcess:
    """scripts/stack.sh COMMAND on the test's own project, state dir and ports."""
    return subprocess.run(["bash", str(STACK), command], cwd=ROOT, env=stack.env, timeout=timeout, **kwargs)


def compose(stack: Stack, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["docker-compose", "--compatibility", "--profile", "cpu", *args], cwd=ROOT, env=stack.env, capture_output=True,
                          text=True, timeout=timeout, check=True)  # fmt: skip


def podman(*args: str, timeout: float = 120) -> str:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=True).stdout


def replicas(service: str = "translator-cpu") -> list[str]:
    """Names of the service's running containers (the translator replicas by default), in order."""
    return sorted(podman("ps", "--filter", f"label=com.docker.compose.project={PROJECT}",
                         "--filter", f"label=com.docker.compose.service={service}", "--format", "{{.Names}}").split())  # fmt: skip


def received_alerts() -> list[dict]:
    """What the alert-receiver service logged: one JSON object per alert of each notification (deploy/alert-receiver.py)."""
    (receiver,) = replicas("alert-receiver")
    return [json.loads(line) for line in podman("logs", receiver).splitlines() if line.startswith("{")]


def translated(container: str) -> float:
    """Translate calls the replica answered OK, read from its /metrics inside the container (not published)."""
    script = ("import urllib.request; text = urllib.request.urlopen('http://127.0.0.1:9300/metrics', timeout=2).read().decode(); "
              "print(sum(float(l.rsplit(' ', 1)[1]) for l in text.splitlines() if l.startswith('nmt_requests_total{') "
              "and 'method=\"Translate\"' in l and 'code=\"OK\"' in l))")  # fmt: skip
    try:
        return float(podman("exec", container, "python3", "-c", script, timeout=20))
    except subprocess.CalledProcessError:
        return 0.0


def container_log(container: str, *options: str) -> str:
    # The replica logs to stderr, which podman logs replays on its own stderr.
    return subprocess.run(["podman", "logs", *options, container], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=30).stdout


def logged_at(container: str, *words: str) -> float | None:
    """Epoch seconds of the container's first log line holding every one of `words` (podman's own log timestamps)."""
    for line in container_log(container, "--timestamps").splitlines():
        if all(word in line for word in words):
            stamp = line.split(" ", 1)[0]  # RFC 3339 with nanoseconds: keep microseconds for fromisoformat
            head, _, rest = stamp.partition(".")
            digits = "".join(itertools.takewhile(str.isdigit, rest))
            return datetime.datetime.fromisoformat(f"{head}.{digits[:6]}{rest[len(digits):].replace('Z', '+00:00')}").timestamp()
    return None


def serving(container: str) -> bool:
    return subprocess.run(["podman", "exec", container, "nmt-health", "--target", "127.0.0.1:50051"], capture_output=True,
                          timeout=20).returncode == 0  # fmt: skip


def prometheus_up(stack: Stack) -> dict[str, float]:
    url = f"{stack.prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": 'up{job="nmt"}'})
    result = json.load(urllib.request.urlopen(url, timeout=5))["data"]["result"]
    return {item["metric"]["instance"]: float(item["value"][1]) for item in result}


def require_containers(stack: Stack) -> None:
    """scripts/stack.sh images, which ends with exit status 3 where its probe container does not run: the tests
    skip with podman's error then, unless podman runs another runtime than the runc the script pins (its
    containers.conf is not the one in effect) or NMT_CONTAINER_TESTS=1; any other failure fails them."""
    started = time.monotonic()
    result = stack_script(stack, "images", capture_output=True, text=True)
    stack.timings["images_s"] = time.monotonic() - started
    if result.returncode == 0:
        return
    if result.returncode != CANNOT_RUN or os.environ.get("NMT_CONTAINER_TESTS") == "1":
        pytest.fail(f"scripts/stack.sh images exited {result.returncode}:\n{result.stderr[-4000:]}")
    reason = result.stderr.strip().splitlines()[-1]
    runtime = podman("info", "--format", "{{.Host.OCIRuntime.Name}}").strip()
    if runtime != "runc":
        pytest.fail(f"podman runs {runtime}, not the runc scripts/stack.sh pins in containers.conf: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = new_stack(tmp_path_factory.mktemp("stack"))
    require_containers(stack)
    started = time.monotonic()
    try:
        stack_script(stack, "up", check=True)
        stack.timings["up_s"] = time.monotonic() - started
        yield stack
    finally:
        stack_script(stack, "down", timeout=300)
        logger.info("stack timings: %s", stack.timings)


def write_conf(conf: Path) -> subprocess.CompletedProcess:
    """scripts/stack.sh conf on `conf` (CONTAINERS_CONF), as any user: no podman, no root."""
    return subprocess.run(["bash", str(STACK), "conf"], env=os.environ | {"CONTAINERS_CONF": str(conf)}, capture_output=True, text=True,
                          timeout=60)  # fmt: skip


# The conf scripts/stack.sh writes where there is none, with the host's hard open-files limit for {0}.
WRITTEN_CONF = ('[containers]\ndefault_ulimits = ["nofile={0}:{0}", "nproc=32768:32768"]\n\n'
                '[engine]\nruntime = "runc"\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n')  # fmt: skip


@pytest.mark.parametrize(
    ("existing", "expected"),
    [
        pytest.param(None, WRITTEN_CONF, id="none"),
        # What scripts/stack.sh wrote before it pinned the runtime: runc goes into the one [engine] table.
        pytest.param('[containers]\ndefault_ulimits = ["nofile=64:64"]\n\n[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n',
                     '[containers]\ndefault_ulimits = ["nofile=64:64"]\n\n[engine]\ncgroup_manager = "cgroupfs"\nevents_logger = "file"\n'
                     'runtime = "runc"\n', id="runtime-missing"),  # fmt: skip
        pytest.param('# site settings\n[engine]\nruntime = "crun"  # the default\nevents_logger = "journald"\n\n[engine.runtimes]\n'
                     'crun = ["/usr/bin/crun"]\n',
                     '# site settings\n[engine]\nruntime = "runc"\nevents_logger = "journald"\ncgroup_manager = "cgroupfs"\n\n'
                     '[engine.runtimes]\ncrun = ["/usr/bin/crun"]\n\n'
                     '[containers]\ndefault_ulimits = ["nofile={0}:{0}", "nproc=32768:32768"]\n',
                     id="crun-set"),  # fmt: skip
        pytest.param('[network]\nnetwork_backend = "netavark"\n', '[network]\nnetwork_backend = "netavark"\n\n' + WRITTEN_CONF,
                     id="other-tables"),  # fmt: skip
    ],
)
def test_stack_conf_pins_runc_and_keeps_what_is_set(tmp_path: Path, existing: str | None, expected: str) -> None:
    conf = tmp_path / "containers.conf"
    if existing is not None:
        conf.write_text(existing)
    assert write_conf(conf).returncode == 0
    written = conf.read_text()
    assert written == expected.format(resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    assert tomllib.loads(written)["engine"]["runtime"] == "runc"  # one table each: TOML refuses a repeated one
    # A second run leaves the file as it is.
    assert write_conf(conf).returncode == 0 and conf.read_text() == written


def test_stack_conf_refuses_a_file_that_is_not_toml(tmp_path: Path) -> None:
    conf = tmp_path / "containers.conf"
    conf.write_text("[engine]\nruntime = crun\n")
    result = write_conf(conf)
    assert result.returncode != 0 and "is not TOML" in result.stderr, result.stderr
    assert conf.read_text() == "[engine]\nruntime = crun\n"


@pytest.mark.container
@needs_containers
def test_stack_serves_through_nginx_with_both_replicas_scraped_and_healthy(stack: Stack, tmp_path: Path) -> None:
    report = tmp_path / "load.json"
    subprocess.run([sys.executable, "-m", "nmt_serve.client.loadtest", "--target", stack.balancer, "--concurrency", "8", "--duration", "10",
                    "--wait-ready", "30", "--json", str(report)], cwd=ROOT, check=True, timeout=120)  # fmt: skip
    result = json.loads(report.read_text())
    assert result["requests"] > 0 and result["codes"] == {"OK": result["requests"]}, result["codes"]
    names = replicas()
    assert len(names) == 2 and all(serving(name) for name in names), names
    assert all(translated(name) > 0 for name in names), "the balancer left a replica without calls"
    # Prometheus finds both replicas through DNS and scrapes them (dns_sd refresh 15 s, scrape every 5 s).
    assert wait_for(lambda: (up := prometheus_up(stack)) and len(up) == 2 and set(up.values()) == {1.0}, 60), prometheus_up(stack)


def post_json(url: str, body: dict) -> urllib.request.Request:
    return urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


@pytest.mark.container
@needs_containers
def test_stack_serves_the_http_api_through_nginx(stack: Stack) -> None:
    """POST /v1/translate and a server-sent events stream through the balancer's HTTP port, as a user calls them."""
    with urllib.request.urlopen(post_json(f"{stack.balancer_http}/v1/translate", {"texts": ["Ich sehe den Hund."]}), timeout=60) as response:
        answer = json.load(response)
    (translation,) = answer["translations"]
    assert answer["model"] == "de-en-small" and translation["hypotheses"][0]["text"], answer
    with urllib.request.urlopen(post_json(f"{stack.balancer_http}/v1/translate/stream", {"text": "Ich sehe den Hund."}), timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [json.loads(line[len(b"data: "):]) for line in response.read().splitlines() if line.startswith(b"data: ")]
    assert len(events) > 1 and events[-1]["final"] and not any(event["final"] for event in events[:-1])
    # The stream ends on the same best hypothesis as the one-shot call, its deltas adding up to it.
    assert events[-1]["hypotheses"][0]["text"] == "".join(event["text_delta"] for event in events) == translation["hypotheses"][0]["text"]
    with urllib.request.urlopen(f"{stack.balancer_http}/readyz", timeout=10) as response:
        assert json.load(response) == {"status": "ready"}


@pytest.mark.container
@needs_containers
def test_stack_rolling_restarts_under_load_fail_no_call(stack: Stack) -> None:
    """`scripts/stack.sh restart` under load: each replica drained (podman restart -t), back in the balancer before the
    next one stops; clients without retries see no failed call."""
    restarts = int(os.environ.get("NMT_STACK_RESTARTS", "1"))
    names = replicas()
    served_before = {name: translated(name) for name in names}
    load = Load(stack.balancer, clients=8)
    started = time.monotonic()
    try:
        for _ in range(restarts):
            result = stack_script(stack, "restart", timeout=600, capture_output=True, text=True)
            logger.info("scripts/stack.sh restart:\n%s", result.stderr)
            assert result.returncode == 0, result.stderr
        time.sleep(2)  # calls sent just after the last restart finish too
        # Each replica answers calls again (its counters start from zero after the restart).
        assert wait_for(lambda: all(translated(name) > 0 for name in names), 60), {name: translated(name) for name in names}
    finally:
        codes = load.stop()
    stack.timings["restarts"] = restarts * len(names)
    stack.timings["restart_s_total"] = time.monotonic() - started
    stack.timings["restart_calls"] = sum(codes.values())
    stack.timings["restart_failed"] = sum(count for code, count in codes.items() if code != "OK")
    logger.info("%d rounds of replica restarts under load: %s (served before: %s)", restarts, dict(codes), served_before)
    assert set(codes) == {"OK"}, (codes, [(time.strftime("%H:%M:%S", time.gmtime(at)), detail) for at, detail in load.failures[:10]])
    for name in names:  # each replica drained: SIGTERM, not SIGKILL
        assert "nmt-serve: draining: " in container_log(name), f"{name} was not drained"


# The behaviour under test is that nginx re-resolves and a new replica gets calls at all (without
# re-resolving it never does). How fast is a measurement (about 5-8 s here, bench/results/stack.md), not
# a bound: the replica's own start (model load, warm-up) on a shared 2-core machine took 12.7 s once.
SCALE_UP_WAIT_S = 60


@pytest.mark.container
@needs_containers
def test_stack_replica_added_under_load_receives_calls(stack: Stack) -> None:
    before = set(replicas())
    load = Load(stack.balancer, clients=8)
    try:
        compose(stack, "up", "-d", "--no-build", "--no-recreate", "--scale", "translator-cpu=3", "translator-cpu")
        started = time.time()
        added = (set(replicas()) - before).pop()
        first = wait_for(lambda: logged_at(added, "nmt_serve.access", "Translate"), SCALE_UP_WAIT_S)
        assert first, f"{added} received no call"
        latency = first - started
        serving_after = (logged_at(added, "nmt-serve: serving") or first) - started
    finally:
        codes = load.stop()
    stack.timings["scale_up_s"] = latency
    logger.info("a replica added by docker-compose up --scale answered its first call %.1f s after the command returned (SERVING after "
                "%.1f s); load: %s", latency, serving_after, dict(codes))  # fmt: skip
    assert set(codes) == {"OK"}, (codes, load.failures[:10])


@pytest.mark.container
@needs_containers
def test_stack_routes_a_replica_down_alert_to_the_receiver(stack: Stack) -> None:
    """A replica paused (its container keeps its address, so Prometheus keeps its target and every scrape fails):
    NmtReplicaDown fires in Prometheus, Alertmanager delivers it to the webhook receiver, and its resolution once the
    replica answers again. The rules' `for:` and the route's waits are short here (write_short_alerting)."""
    victim = replicas()[0]
    address = podman("inspect", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}", victim).strip()

    def delivered(status: str) -> list[dict]:
        return [alert for alert in received_alerts() if alert["labels"]["alertname"] == "NmtReplicaDown" and alert["status"] == status
                and alert["labels"]["instance"] == f"{address}:9300"]  # fmt: skip

    podman("pause", victim)
    try:
        firing = wait_for(lambda: delivered("firing"), 120)
    finally:
        podman("unpause", victim)
    assert firing, (received_alerts(), json.load(urllib.request.urlopen(f"{stack.prometheus}/api/v1/alerts", timeout=5)))
    assert firing[0]["receiver"] == "webhook" and firing[0]["labels"]["severity"] == "page"
    assert firing[0]["labels"]["app_kubernetes_io_name"] == "nmt-serve" and firing[0]["annotations"]["summary"] == f"nmt-serve replica {address}:9300 is down"
    assert wait_for(lambda: delivered("resolved"), 120), received_alerts()
    assert wait_for(lambda: serving(victim), 60)


# Run inside the image: what pip installed nmt-serve from, and anything a source build leaves behind.
IMAGE_CONTENTS = """
import importlib.metadata, json, os
leftovers = []
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys", "/dev"):
        dirs[:] = []
        continue
    leftovers += [os.path.join(root, name) for name in dirs if name.endswith(".egg-info")]
    leftovers += [os.path.join(root, name) for name in dirs if name == "build" and os.path.isdir(os.path.join(root, name, "lib"))]
    if "pyproject.toml" in files and 'name = "nmt-serve"' in open(os.path.join(root, "pyproject.toml")).read():
        leftovers.append(root)  # nmt-serve's source tree
dist = importlib.metadata.distribution("nmt-serve")
print(json.dumps({"leftovers": leftovers, "installed_from": dist.read_text("INSTALLER"), "metadata_dir": str(dist._path),
                  "version": dist.version, "commit": os.environ.get("NMT_BUILD_COMMIT")}))
"""


def expected_revision() -> str:
    """What scripts/stack.sh labels the image with: this checkout's commit, "-dirty" with changes; empty outside git."""
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode != 0:
        return ""
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--"], cwd=ROOT).returncode != 0
    return git.stdout.strip() + ("-dirty" if dirty else "")


@pytest.mark.container
@needs_containers
def test_stack_image_is_labelled_and_holds_no_build_leftovers(stack: Stack) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", "localhost/nmt-serve:cpu"))
    assert labels["org.opencontainers.image.version"] == version
    assert labels["org.opencontainers.image.revision"] == expected_revision()
    assert "org.opencontainers.image.source" in labels and labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    inside = json.loads(podman("run", "--rm", "--entrypoint", "python3", "localhost/nmt-serve:cpu", "-c", IMAGE_CONTENTS, timeout=300))
    assert inside["leftovers"] == [], inside["leftovers"]
    # Installed from the wheel (a .dist-info), and the image's commit is what nmt_build_info reports.
    assert inside["metadata_dir"].endswith(f"nmt_serve-{version}.dist-info") and inside["version"] == version, inside
    assert inside["commit"] == labels["org.opencontainers.image.revision"]
    stack.timings["image_mb"] = int(podman("image", "inspect", "--format", "{{.Size}}", "localhost/nmt-serve:cpu")) / 1e6


@pytest.mark.container
@needs_containers
def test_stack_down_leaves_nothing_running(stack: Stack) -> None:
    others = set(podman("ps", "-q").split()) - set(podman("ps", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").split())
    stack_script(stack, "down", check=True, timeout=300)
    assert podman("ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}").split() == []
    assert others <= set(podman("ps", "-q").split()), "down stopped containers of another project"
    assert not (stack.state / "podman.pid").exists() and not (stack.state / "healthcheck.pid").exists()
    service = subprocess.run(["pgrep", "-f", f"podman system service --time=0 unix://{stack.state}/"], capture_output=True, text=True)
    assert service.stdout.strip() == "", service.stdout
