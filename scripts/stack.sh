#!/usr/bin/env bash
# The compose stack (two CPU translator replicas, nginx, Prometheus, Alertmanager and its webhook receiver) on podman +
# docker-compose 1.29:
#   scripts/stack.sh up      install what is missing, build the CPU image, start the stack, wait until it serves
#   scripts/stack.sh down    docker-compose down, then end the podman service and healthcheck loop this script started
#   scripts/stack.sh restart restart the translator replicas one at a time, each drained (podman restart -t), each back in
#                            the balancer before the next
#   scripts/stack.sh images  only the set-up: packages, containers.conf, base images, a container run, wheelhouse
#   scripts/stack.sh conf    only containers.conf (CONTAINERS_CONF names another file, as it does for podman)
# Idempotent: each step is skipped when its result exists. Run as root on Debian bookworm.
# Exit status 3: no container can run on this machine; the last line says why, with podman's own error.
# Settings, from the environment:
#   NMT_STACK_PROJECT  the compose project (default COMPOSE_PROJECT_NAME, else nmt); `down` ends this project only
#   NMT_STACK_DIR      state: socket, PIDs, logs (default /run/nmt-stack for project nmt, /run/nmt-stack-PROJECT else)
#   NMT_BIND, NMT_BALANCER_PORT, NMT_BALANCER_HTTP_PORT, NMT_PROMETHEUS_PORT, NMT_ALERTMANAGER_PORT  where the stack
#                      publishes (docker-compose.yml; 127.0.0.1, 8080 gRPC, 8000 HTTP/JSON, 9090, 9093)
#   NMT_STACK_REBUILD=1 builds the CPU image without the layer cache.
#   NMT_STOP_TIMEOUT_S  how long `restart` lets a replica drain before SIGKILL (default 30: docker-compose.yml's stop_grace_period)
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=${NMT_STACK_PROJECT:-${COMPOSE_PROJECT_NAME:-nmt}}
export COMPOSE_PROJECT_NAME=$PROJECT
if [ "$PROJECT" = nmt ]; then STATE=${NMT_STACK_DIR:-/run/nmt-stack}; else STATE=${NMT_STACK_DIR:-/run/nmt-stack-$PROJECT}; fi
SOCKET="$STATE/podman.sock"
export DOCKER_HOST="unix://$SOCKET"
# Grafana is not started here (no image of it is built); compose still requires its password to parse the file.
export GRAFANA_ADMIN_PASSWORD=${GRAFANA_ADMIN_PASSWORD:-unused-grafana-not-started}
COMPOSE=(docker-compose --compatibility --profile cpu)
SERVICES=(translator-cpu balancer-cpu prometheus alertmanager alert-receiver)
WHEELHOUSE=deploy/wheelhouse
PACKAGES=(podman runc buildah debootstrap fuse-overlayfs slirp4netns uidmap docker-compose python3-venv curl)
CANNOT_RUN=3

log() { echo "stack: $*" >&2; }

install_packages() {
    local missing=()
    for package in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
    done
    [ ${#missing[@]} -eq 0 ] && return
    log "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
}

# The containers.conf settings podman needs here. Each is added to its table where the file has one (TOML allows a
# table once) and left as it is where already set, except the runtime: Debian installs crun beside runc and podman
# prefers crun, which refuses hosts whose cgroups are in hybrid v1/v2 mode, so runc is pinned.
# - default_ulimits: podman cannot raise rlimits where the host forbids it, so containers get the host's hard nofile
#   limit and the nproc limit that runc can still set.
# - cgroup_manager, events_logger: no systemd.
write_containers_conf() {
    local conf=${CONTAINERS_CONF:-/etc/containers/containers.conf}
    mkdir -p "$(dirname "$conf")"
    CONF=$conf NOFILE=$(ulimit -Hn) python3 - <<'EOF'
import json, os, re, sys, tomllib
from pathlib import Path

nofile = os.environ["NOFILE"]
# (table, key, value, whether another value already set is replaced)
SETTINGS = [
    ("containers", "default_ulimits", [f"nofile={nofile}:{nofile}", "nproc=32768:32768"], False),
    ("engine", "runtime", "runc", True),
    ("engine", "cgroup_manager", "cgroupfs", False),
    ("engine", "events_logger", "file", False),
]
HEADER = re.compile(r"\s*(\[\[?)\s*([A-Za-z0-9_.-]+)\s*\]\]?\s*(#.*)?")


def missing(document: dict) -> list[tuple]:
    """The settings `document` lacks, or holds with another value where that is replaced."""
    return [(table, key, value, replace) for table, key, value, replace in SETTINGS
            if key not in document.get(table, {}) or (replace and document[table][key] != value)]


def set_line(lines: list[str], table: str, key: str, setting: str) -> None:
    """`setting` in place of the table's KEY line, else after its last line that is not blank, else in a new table."""
    headers = [(index, HEADER.fullmatch(line)) for index, line in enumerate(lines) if HEADER.fullmatch(line)]
    start = next((index for index, header in headers if header.group(1) == "[" and header.group(2) == table), None)
    if start is None:
        lines += ([""] if lines and lines[-1].strip() else []) + [f"[{table}]", setting]
        return
    end = next((index for index, _ in headers if index > start), len(lines))
    found = next((index for index in range(start + 1, end) if re.match(rf"\s*{key}\s*=", lines[index])), None)
    if found is not None:
        lines[found] = setting
    else:
        lines.insert(max((index for index in range(start + 1, end) if lines[index].strip()), default=start) + 1, setting)


conf = Path(os.environ["CONF"])
text = conf.read_text() if conf.exists() else ""
try:
    todo = missing(tomllib.loads(text))
except tomllib.TOMLDecodeError as error:
    sys.exit(f"stack: {conf} is not TOML ({error}): correct it, or remove it to have it written")
if not todo:
    sys.exit(0)
lines = text.splitlines()
for table, key, value, _ in todo:
    set_line(lines, table, key, f"{key} = {json.dumps(value)}")
written = "\n".join(lines) + "\n"
try:
    wrong = missing(tomllib.loads(written))
except tomllib.TOMLDecodeError as error:
    sys.exit(f"stack: cannot add podman's settings to {conf} ({error}): set them by hand")
if wrong:
    sys.exit(f"stack: cannot set {', '.join(f'[{table}] {key}' for table, key, *_ in wrong)} in {conf}: set them by hand")
partial = conf.with_name(conf.name + ".partial")
partial.write_text(written)
if conf.exists():
    partial.chmod(conf.stat().st_mode)
partial.replace(conf)
print(f"stack: wrote podman's settings into {conf}", file=sys.stderr)
EOF
}

# The Debian mirror this machine's apt uses (deb822 or one-line sources), never a fixed address.
debian_mirror() {
    local uri
    uri=$(grep -hE '^URIs:' /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v security | awk '{print $2; exit}')
    [ -n "$uri" ] || uri=$(grep -hE '^deb ' /etc/apt/sources.list 2>/dev/null | grep -v security | awk '{print $2; exit}')
    [ -n "$uri" ] || { log "no Debian mirror in /etc/apt/sources.list{,.d}"; exit 1; }
    echo "$uri"
}

have_image() { podman image exists "$1"; }

# Debian bookworm from the mirror, the base of every image here (importing it runs no container).
build_debian_image() {
    have_image localhost/debian:bookworm && return
    local rootfs
    rootfs=$(mktemp -d)
    log "debootstrap bookworm from $(debian_mirror)"
    debootstrap --variant=minbase bookworm "$rootfs" "$(debian_mirror)" >"$STATE/debootstrap.log"
    tar -C "$rootfs" -c . | podman import - localhost/debian:bookworm >/dev/null
    rm -rf "$rootfs"
}

# A container from the base image runs, or the script ends here with podman's reason, before minutes of building.
check_containers_run() {
    local error runtime
    error=$(podman run --rm localhost/debian:bookworm true 2>&1) && return
    runtime=$(podman info --format '{{.Host.OCIRuntime.Name}}' 2>/dev/null) || runtime=unknown
    log "no container can run on this machine (podman's OCI runtime: $runtime): ${error//$'\n'/ }"
    exit "$CANNOT_RUN"
}

# The images the Dockerfile and compose file name, built from Debian packages where no registry is reachable: the
# same names, so that both files build and run unchanged.
build_stand_ins() {
    local python_image nginx_image prometheus_image alertmanager_image
    python_image=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)
    nginx_image=$(sed -n 's/^ *image: \(nginx:.*\)/\1/p' docker-compose.yml)
    prometheus_image=$(sed -n 's/^ *image: \(prom\/prometheus:.*\)/\1/p' docker-compose.yml)
    alertmanager_image=$(sed -n 's/^ *image: \(prom\/alertmanager:.*\)/\1/p' docker-compose.yml)
    stand_in "$python_image" "python3 python3-venv passwd" \
        'RUN python3 -m venv /usr/local/python && ln -s /usr/local/python/bin/pip /usr/local/bin/pip
ENV PATH=/usr/local/python/bin:$PATH
CMD ["python3"]'
    stand_in "$nginx_image" "nginx curl wget" 'STOPSIGNAL SIGQUIT
CMD ["nginx", "-g", "daemon off;"]'
    stand_in "docker.io/$prometheus_image" "prometheus wget" 'RUN mkdir -p /prometheus && chown prometheus /prometheus
USER prometheus
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
    # The official image's layout: /bin/alertmanager (/bin is /usr/bin in Debian) as user nobody in /alertmanager.
    stand_in "docker.io/$alertmanager_image" "prometheus-alertmanager wget" 'RUN ln -s prometheus-alertmanager /usr/bin/alertmanager \
    && mkdir -p /alertmanager && chown nobody /alertmanager
USER nobody
WORKDIR /alertmanager
EXPOSE 9093
ENTRYPOINT ["/bin/alertmanager"]
CMD ["--config.file=/etc/alertmanager/alertmanager.yml", "--storage.path=/alertmanager"]'
}

# stand_in NAME "PACKAGES" "DOCKERFILE LINES": Debian + those packages, tagged NAME.
stand_in() {
    local name=$1 packages=$2 tail=$3 context
    case $name in */*) ;; *) name="docker.io/library/$name" ;; esac
    have_image "$name" && return
    log "building a stand-in for $name from Debian $packages"
    context=$(mktemp -d)
    printf 'FROM localhost/debian:bookworm\nRUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends %s && rm -rf /var/lib/apt/lists/*\n%s\n' \
        "$packages" "$tail" >"$context/Dockerfile"
    podman build --format docker -q -t "$name" "$context" >/dev/null
    rm -rf "$context"
}

# The wheels the CPU image installs, for CPython 3.11 on manylinux x86_64: builds need no index, and install the
# same versions every time until the wheelhouse is emptied. Downloaded again when pyproject.toml's requirements change.
fill_wheelhouse() {
    local venv requirements
    requirements=$(python3 - <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
extras, wanted, seen = project["optional-dependencies"], list(project["dependencies"]), set()
todo = ["serve-cpu"]
while todo:
    extra = todo.pop()
    for requirement in extras[extra]:
        inner = re.fullmatch(r"nmt-serve\[([\w-]+)\]", requirement)
        if inner and inner.group(1) not in seen:
            seen.add(inner.group(1)); todo.append(inner.group(1))
        elif not inner:
            wanted.append(requirement)
print("\n".join(sorted(set(wanted)) + ["setuptools>=70.1"]))
EOF
)
    [ "$requirements" = "$(cat "$WHEELHOUSE/requirements.txt" 2>/dev/null)" ] && return
    venv=$(mktemp -d)
    python3 -m venv "$venv"
    log "downloading wheels into $WHEELHOUSE"
    # shellcheck disable=SC2086
    "$venv/bin/pip" download -q --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
        -d "$WHEELHOUSE" $requirements
    echo "$requirements" >"$WHEELHOUSE/requirements.txt"
    rm -rf "$venv"
}

images() {
    mkdir -p "$STATE"
    install_packages
    write_containers_conf
    build_debian_image
    check_containers_run
    build_stand_ins
    fill_wheelhouse
}

start_service() {
    if [ -f "$STATE/podman.pid" ] && kill -0 "$(cat "$STATE/podman.pid")" 2>/dev/null; then return; fi
    podman system service --time=0 "$DOCKER_HOST" </dev/null >"$STATE/podman-service.log" 2>&1 &
    echo $! >"$STATE/podman.pid"
    for _ in $(seq 100); do [ -S "$SOCKET" ] && return; sleep 0.1; done
    log "podman service did not open $SOCKET"; exit 1
}

# podman runs healthchecks from systemd timers; without systemd nothing runs them, so this loop does.
start_healthchecks() {
    if [ -f "$STATE/healthcheck.pid" ] && kill -0 "$(cat "$STATE/healthcheck.pid")" 2>/dev/null; then return; fi
    (
        while :; do
            for container in $(podman ps -q --filter "label=com.docker.compose.project=$PROJECT" \
                --filter health=starting --filter health=healthy --filter health=unhealthy); do
                podman healthcheck run "$container" >/dev/null 2>&1 || true
            done
            sleep 2
        done
    ) </dev/null >>"$STATE/healthcheck.log" 2>&1 &
    echo $! >"$STATE/healthcheck.pid"
}

# grpc.health.v1 through HOST:PORT answers SERVING (the check deploy/nginx-upstreams.sh makes of each replica).
grpc_serving() {
    printf '\000\000\000\000\000' |
        curl -s -m 2 --http2-prior-knowledge -H 'content-type: application/grpc' -H 'te: trailers' --data-binary @- \
            "http://$1/grpc.health.v1.Health/Check" 2>/dev/null | od -An -tx1 | tr -d ' \n' | grep -qx '00000000020801'
}

# The host address a service's port is published on (docker-compose.yml's NMT_BIND and port settings), as a client
# on this host reaches it.
published() {
    local address
    address=$("${COMPOSE[@]}" port "$1" "$2")
    echo "${address/#0.0.0.0:/127.0.0.1:}"
}

stop_pid() {
    local file=$1
    [ -f "$file" ] || return 0
    kill "$(cat "$file")" 2>/dev/null || true
    rm -f "$file"
}

# The Dockerfile's OCI label arguments: pyproject.toml's version, the checkout's commit ("-dirty" with changes to
# tracked files; empty outside git) and its origin's URL (empty without one).
image_labels() {
    local revision=""
    if git rev-parse --git-dir >/dev/null 2>&1; then
        revision=$(git rev-parse HEAD)
        git diff --quiet HEAD -- 2>/dev/null || revision="$revision-dirty"
    fi
    build_labels=(--build-arg "VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')"
                  --build-arg "REVISION=$revision" --build-arg "SOURCE=$(git remote get-url origin 2>/dev/null || true)"
                  --build-arg "SOURCE_DIGEST=$(source_digest)")
}

# One digest of the files the images build nmt-serve's wheel from. buildah keeps a RUN layer whose bind mount comes from
# another stage even after that stage's files changed (the mounted content is not part of its cache key), so an edited
# checkout would get the wheel of an earlier build; a build argument's value is part of the key of every RUN after it.
source_digest() {
    find pyproject.toml README.md model export importers runtime bench server client protos -type f \
        ! -path '*/__pycache__/*' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

up() {
    images
    local build_labels
    image_labels
    # Built every time, so that the stack runs this checkout; the layer cache makes an unchanged build quick.
    local cache=()
    [ "${NMT_STACK_REBUILD:-0}" = 1 ] && cache=(--no-cache)
    log "building nmt-serve:cpu"
    podman build "${cache[@]}" --format docker --target cpu "${build_labels[@]}" -t localhost/nmt-serve:cpu . >"$STATE/build.log" 2>&1 ||
        { tail -30 "$STATE/build.log"; exit 1; }
    start_service
    start_healthchecks
    "${COMPOSE[@]}" up -d --no-build "${SERVICES[@]}"
    local balancer balancer_http prometheus alertmanager
    balancer=$(published balancer-cpu 8080)
    balancer_http=$(published balancer-cpu 8000)
    prometheus=$(published prometheus 9090)
    alertmanager=$(published alertmanager 9093)
    for _ in $(seq 120); do
        grpc_serving "$balancer" && curl -fsS "http://$balancer_http/readyz" >/dev/null 2>&1 &&
            curl -fsS "http://$prometheus/-/ready" >/dev/null 2>&1 && curl -fsS "http://$alertmanager/-/ready" >/dev/null 2>&1 && {
            log "up: project $PROJECT, balancer on $balancer (gRPC) and http://$balancer_http (HTTP/JSON), Prometheus on $prometheus," \
                "Alertmanager on $alertmanager"
            return; }
        sleep 1
    done
    log "the stack did not become ready"; "${COMPOSE[@]}" ps; exit 1
}

container_of() { podman ps --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | sort; }

# A rolling restart that fails no call. Each replica gets SIGTERM and NMT_STOP_TIMEOUT_S seconds to drain before it
# is killed: `podman restart` and `docker restart` need -t for that (podman's Docker API restarts with no timeout
# given kill a replica at once, failing the calls it holds). The next replica stops only once this one is SERVING and
# nginx-upstreams.sh has put it back into nginx's upstreams, so that one replica's capacity is away at a time.
restart() {
    local timeout=${NMT_STOP_TIMEOUT_S:-30} balancer container address started
    start_service
    balancer=$(container_of balancer-cpu)
    for container in $(container_of translator-cpu); do
        started=$SECONDS
        log "restarting $container (SIGTERM, up to $timeout s to drain)"
        # podman's own messages about systemd healthcheck timers (there is no systemd here) only on failure.
        podman restart -t "$timeout" "$container" >/dev/null 2>"$STATE/restart.log" || { cat "$STATE/restart.log" >&2; exit 1; }
        address=$(podman inspect --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}' "$container")
        for _ in $(seq 120); do
            podman exec "$container" nmt-health --target 127.0.0.1:50051 >/dev/null 2>&1 &&
                podman exec "$balancer" grep -q "server $address:50051 " /tmp/nginx-run/nginx.conf 2>/dev/null && break
            sleep 1
        done
        podman exec "$balancer" grep -q "server $address:50051 " /tmp/nginx-run/nginx.conf ||
            { log "$container ($address) is not back in the balancer"; exit 1; }
        log "$container is back in the balancer after $((SECONDS - started)) s"
    done
}

down() {
    mkdir -p "$STATE"
    command -v podman >/dev/null || return 0
    start_service
    "${COMPOSE[@]}" down --remove-orphans --timeout 30 || true
    stop_pid "$STATE/healthcheck.pid"
    stop_pid "$STATE/podman.pid"
    rm -f "$SOCKET"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    restart) restart ;;
    images) images ;;
    conf) write_containers_conf ;;
    *) echo "usage: $0 up|down|restart|images|conf" >&2; exit 2 ;;
esac
