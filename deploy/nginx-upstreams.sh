#!/bin/sh
# nginx in front of the translator replicas that serve now. nginx OSS resolves an upstream name only when it loads
# its configuration, so replicas added later (docker compose up --scale) would get no calls: this script runs nginx
# on a copy of NMT_NGINX_TEMPLATE whose "server NAME:PORT ...;" line becomes one line per replica that answers
# grpc.health.v1 SERVING, resolves NAME every NMT_RESOLVE_INTERVAL_S seconds, and reloads nginx when that set changes.
# A "server NAME:HTTP_PORT ...;" line (the HTTP/JSON API's upstream) becomes one line per such replica too, each
# replica's address with HTTP_PORT. A replica warming up or draining (NOT_SERVING) gets no calls. POSIX sh; needs
# getent, curl with HTTP/2, od.
#
# Settings (environment): NMT_NGINX_TEMPLATE (default /etc/nginx/nginx.conf), NMT_UPSTREAM_NAME (translator),
# NMT_UPSTREAM_PORT (50051), NMT_UPSTREAM_HTTP_PORT (8000; empty: no HTTP upstream line), NMT_RESOLVE_INTERVAL_S
# (1), NMT_NGINX_WORK (/tmp/nginx-run: the generated configuration), NMT_NGINX (nginx), NMT_UPSTREAM_ADDRESSES
# (host:port list used instead of resolving NAME).
set -eu

TEMPLATE=${NMT_NGINX_TEMPLATE:-/etc/nginx/nginx.conf}
NAME=${NMT_UPSTREAM_NAME:-translator}
PORT=${NMT_UPSTREAM_PORT:-50051}
HTTP_PORT=${NMT_UPSTREAM_HTTP_PORT-8000}
INTERVAL=${NMT_RESOLVE_INTERVAL_S:-1}
WORK=${NMT_NGINX_WORK:-/tmp/nginx-run}
NGINX=${NMT_NGINX:-nginx}
CONF="$WORK/nginx.conf"

log() { echo "nginx-upstreams: $*" >&2; }

addresses() {
    if [ -n "${NMT_UPSTREAM_ADDRESSES:-}" ]; then
        printf '%s\n' $NMT_UPSTREAM_ADDRESSES
    else
        # ahostsv4 lists every address (glibc); musl's getent knows only "hosts", which lists them too.
        { getent ahostsv4 "$NAME" 2>/dev/null || getent hosts "$NAME" 2>/dev/null || true; } |
            awk -v port="$PORT" '$1 ~ /^[0-9.]+$/ { print $1 ":" port }'
    fi | sort -u
}

# grpc.health.v1 Check of the whole server, plaintext HTTP/2: the request is one empty message (5 zero bytes), and
# a SERVING answer is the message 08 01 behind its 5-byte prefix.
serving() {
    printf '\000\000\000\000\000' |
        curl -s -m 2 --http2-prior-knowledge -H 'content-type: application/grpc' -H 'te: trailers' --data-binary @- \
            "http://$1/grpc.health.v1.Health/Check" 2>/dev/null | od -An -tx1 | tr -d ' \n' | grep -qx '00000000020801'
}

serving_addresses() {
    for address in $(addresses); do
        if serving "$address"; then echo "$address"; fi
    done
}

# The template with its upstream lines repeated for each address in $1 (their parameters kept): the gRPC line with
# the addresses as they are, the HTTP line with each address's port replaced by HTTP_PORT.
render() {
    UPSTREAMS=$1 awk -v name="$NAME:$PORT" -v http_name="${HTTP_PORT:+$NAME:$HTTP_PORT}" -v http_port="$HTTP_PORT" '
        $1 == "server" && ($2 == name || (http_name != "" && $2 == http_name)) {
            found = $2
            indent = substr($0, 1, index($0, "server") - 1)
            params = substr($0, index($0, found) + length(found))
            n = split(ENVIRON["UPSTREAMS"], list, " ")
            for (i = 1; i <= n; i++) {
                address = list[i]
                if (found != name) sub(/:[0-9]+$/, ":" http_port, address)
                print indent "server " address params
            }
            next
        }
        { print }' "$TEMPLATE" >"$CONF.new"
    mv "$CONF.new" "$CONF"
}

mkdir -p "$WORK"
current=""
until [ -n "$current" ]; do
    current=$(serving_addresses | tr '\n' ' ')
    [ -n "$current" ] || { log "no $NAME replica serving yet"; sleep "$INTERVAL"; }
done
render "$current"
log "upstreams: $current"
"$NGINX" -c "$CONF" -g 'daemon off;' &
nginx_pid=$!
# QUIT lets nginx finish the calls it carries; TERM and INT end it at once, as they would nginx itself.
trap 'kill -QUIT $nginx_pid 2>/dev/null; wait $nginx_pid; exit 0' QUIT
trap 'kill -TERM $nginx_pid 2>/dev/null; wait $nginx_pid; exit 0' TERM INT

while kill -0 "$nginx_pid" 2>/dev/null; do
    sleep "$INTERVAL" &
    wait $! || true
    found=$(serving_addresses | tr '\n' ' ')
    # With no replica serving, the last set stays: nginx's retries and its refused connections then answer.
    if [ -n "$found" ] && [ "$found" != "$current" ]; then
        render "$found"
        if "$NGINX" -t -q -c "$CONF" 2>/dev/null && kill -HUP "$nginx_pid"; then
            log "upstreams: $found (reloaded)"
            current=$found
        fi
    fi
done
wait "$nginx_pid"
