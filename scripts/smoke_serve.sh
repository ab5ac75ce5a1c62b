#!/usr/bin/env bash
# README command 1 on a clean environment: only the serve extra `make serve` picks (no torch, no onnx), the shipped
# model, then nmt-translate must print English. Usage: scripts/smoke_serve.sh VENV_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:?usage: scripts/smoke_serve.sh VENV_DIR}
WORK=$(mktemp -d)
trap 'kill "$SERVER" 2>/dev/null || true; rm -rf "$WORK"' EXIT

python3 -m venv "$VENV"
"$VENV/bin/pip" install -q -e ".[$(scripts/serve_extra.sh "$VENV/bin/python")]"
for forbidden in torch onnx; do
    if "$VENV/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$forbidden') is None)"; then
        echo "smoke: the serve extra installed $forbidden" >&2
        exit 1
    fi
done

# A command of another extra says which one instead of a traceback.
if "$VENV/bin/nmt-train" --help 2>"$WORK/train.err"; then echo "smoke: nmt-train ran without torch" >&2; exit 1; fi
grep -q "pip install 'nmt-serve\[train\]'" "$WORK/train.err" || { echo "smoke: nmt-train did not name its extra" >&2; cat "$WORK/train.err" >&2; exit 1; }

"$VENV/bin/nmt-serve" --port 0 --port-file "$WORK/port" >"$WORK/server.log" 2>&1 &
SERVER=$!
for _ in $(seq 600); do
    [ -s "$WORK/port" ] && break
    kill -0 "$SERVER" 2>/dev/null || { cat "$WORK/server.log" >&2; exit 1; }
    sleep 0.1
done
[ -s "$WORK/port" ] || { echo "smoke: nmt-serve did not become ready" >&2; cat "$WORK/server.log" >&2; exit 1; }

OUTPUT=$("$VENV/bin/nmt-translate" --target "127.0.0.1:$(cat "$WORK/port")" "Ich habe Hunger." "Guten Morgen")
echo "$OUTPUT"
[ "$(echo "$OUTPUT" | grep -c '[A-Za-z]')" -eq 2 ] || { echo "smoke: expected two English lines" >&2; exit 1; }

kill -TERM "$SERVER"
wait "$SERVER"  # a drained server exits 0; set -e fails the script otherwise
echo "smoke: serve extra without torch/onnx, translated, drained and exited 0"
