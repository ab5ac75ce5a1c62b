#!/usr/bin/env bash
# Which extra serves on this machine: `serve` (onnxruntime-gpu, 340 MB installed, CUDA when present) where an
# NVIDIA driver is loaded or onnxruntime-gpu is already installed (the two onnxruntime wheels install the
# same module and must not be mixed), `serve-cpu` (onnxruntime, 78 MB) elsewhere. Usage: serve_extra.sh PYTHON
PYTHON=${1:-python3}
if [ -e /proc/driver/nvidia/version ] || "$PYTHON" -c "import importlib.metadata as m; m.version('onnxruntime-gpu')" 2>/dev/null; then
    echo serve
else
    echo serve-cpu
fi
