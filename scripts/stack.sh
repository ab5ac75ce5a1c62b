#!/usr/bin/env bash
# The compose stack (two CPU translator replicas, nginx, Prometheus) on podman + docker-compose 1.29:
#   scripts/stack.sh up      install what is missing, build the CPU image, start the stack, wait until it serves
#   scripts/stack.sh down    docker-compose down, then end the podman service and healthcheck loop this script started
#   scripts/stack.sh images  only the set-up: packages, containers.conf, base images, wheelhouse
# Idempotent: each step is skipped when its result exists. Run as root on Debian bookworm.
# Settings: NMT_STACK_DIR (state: socket, PIDs, logs; default /run/nmt-stack), NMT_STACK_REBUILD=1 builds the CPU image
# without the layer cache.
set -euo pipefail
cd "$(dirname "$0")/.."

STATE=${NMT_STACK_DIR:-/run/nmt-stack}
SOCKET="$STATE/podman.sock"
export DOCKER_HOST="unix://$SOCKET"
# Grafana is not started here (no image of it is built); compose still requires its password to parse the file.
export GRAFANA_ADMIN_PASSWORD=${GRAFANA_ADMIN_PASSWORD:-unused-grafana-not-started}
export COMPOSE_PROJECT_NAME=${COMPOSE_PROJECT_NAME:-nmt}
COMPOSE=(docker-compose --compatibility --profile cpu)
SERVICES=(translator-cpu balancer-cpu prometheus)
WHEELHOUSE=deploy/wheelhouse
PACKAGES=(podman buildah debootstrap fuse-overlayfs slirp4netns uidmap docker-compose python3-venv curl)

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

# podman cannot raise rlimits where the host forbids it: containers get the host's hard nofile limit, and the
# nproc limit that runc can still set. No systemd: cgroupfs, and events to a file.
write_containers_conf() {
    local conf=/etc/containers/containers.conf nofile
    grep -q "^default_ulimits" "$conf" 2>/dev/null && return
    nofile=$(ulimit -Hn)
    mkdir -p /etc/containers
    cat >>"$conf" <<EOF
[containers]
default_ulimits = ["nofile=$nofile:$nofile", "nproc=32768:32768"]

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
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

# Debian bookworm from the mirror, then the images the Dockerfile and compose file name, built from Debian packages
# where no registry is reachable: the same names, so that both files build and run unchanged.
build_base_images() {
    if ! have_image localhost/debian:bookworm; then
        local rootfs
        rootfs=$(mktemp -d)
        log "debootstrap bookworm from $(debian_mirror)"
        debootstrap --variant=minbase bookworm "$rootfs" "$(debian_mirror)" >"$STATE/debootstrap.log"
        tar -C "$rootfs" -c . | podman import - localhost/debian:bookworm >/dev/null
        rm -rf "$rootfs"
    fi
    local python_image nginx_image prometheus_image
    python_image=$(sed -n 's/^ARG PYTHON_IMAGE=//p' Dockerfile)
    nginx_image=$(sed -n 's/^ *image: \(nginx:.*\)/\1/p' docker-compose.yml)
    prometheus_image=$(sed -n 's/^ *image: \(prom\/prometheus:.*\)/\1/p' docker-compose.yml)
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
    build_base_images
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
            for container in $(podman ps -q --filter health=starting --filter health=healthy --filter health=unhealthy); do
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

stop_pid() {
    local file=$1
    [ -f "$file" ] || return 0
    kill "$(cat "$file")" 2>/dev/null || true
    rm -f "$file"
}

up() {
    images
    # Built every time, so that the stack runs this checkout; the layer cache makes an unchanged build quick.
    local cache=()
    [ "${NMT_STACK_REBUILD:-0}" = 1 ] && cache=(--no-cache)
    log "building nmt-serve:cpu"
    podman build "${cache[@]}" --format docker --target cpu -t localhost/nmt-serve:cpu . >"$STATE/build.log" 2>&1 ||
        { tail -30 "$STATE/build.log"; exit 1; }
    start_service
    start_healthchecks
    "${COMPOSE[@]}" up -d --no-build "${SERVICES[@]}"
    for _ in $(seq 120); do
        grpc_serving 127.0.0.1:8080 && curl -fsS http://127.0.0.1:9090/-/ready >/dev/null 2>&1 && {
            log "up: balancer on 127.0.0.1:8080, Prometheus on 127.0.0.1:9090"; return; }
        sleep 1
    done
    log "the stack did not become ready"; "${COMPOSE[@]}" ps; exit 1
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
    images) images ;;
    *) echo "usage: $0 up|down|images" >&2; exit 2 ;;
esac
