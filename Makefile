# The two set-up commands of the README, and their parts.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test serve kernels corpus corpus-packages protos k8s-rules stack stack-down stack-restart stack-test gpu-check

# torch first and pinned: anything that pulls an unpinned torch would fetch GB of CUDA wheels.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	@$(MAKE) --no-print-directory kernels PYTHON=$(PYTHON)

test: install
	$(PYTHON) -m pytest -q

# Serving needs only a serve extra: no torch, no onnx (CI checks both). The CPU wheel of ONNX Runtime
# on a machine without an NVIDIA driver, the GPU one where there is one (scripts/serve_extra.sh).
serve:
	$(PIP) install -q -e ".[$$(scripts/serve_extra.sh $(PYTHON))]"
	@$(MAKE) --no-print-directory kernels PYTHON=$(PYTHON)
	$(PYTHON) -m nmt_serve.server.main $(SERVE_ARGS)

# The native attention kernels (runtime/kernels/; needs g++ and fetches ONNX Runtime's headers from Debian once), and
# the engine's host work in C (runtime/build_extensions.py: beam search's choice, cache moves; needs this Python's headers).
# Best effort: where they cannot be built the server runs ONNX Runtime's own kernels, and says so.
kernels:
	@$(PYTHON) -m nmt_serve.runtime.build_kernels $$([ -f runtime/kernels/ort-headers/onnxruntime_cxx_api.h ] || echo --download-headers) \
		|| echo "make kernels: not built (the reason is above); the server runs ONNX Runtime's own kernels"

# The real German->English corpus (needs the Debian package trans-de-en; `make corpus-packages`
# installs it with the packages whose catalogs and help pages the shipped model was trained on).
# The shipped model's recipe: the Ding example sentences (the test domain) written 4 times.
corpus: install
	nmt-corpus --out data/corpus --sentence-copies 4

corpus-packages:
	apt-get install -y $$(grep -v '^#' scripts/corpus_packages.txt)
	apt-get install -y --no-install-recommends $$(grep -v '^#' scripts/corpus_packages_norecommends.txt)

# Regenerate the committed gRPC code after editing a .proto (tests fail while it is stale).
protos:
	$(PYTHON) -m nmt_serve.protos.generate

# deploy/k8s/monitoring/prometheusrule.yaml from deploy/alerts.yml (tests fail while it is stale).
k8s-rules:
	$(PYTHON) scripts/prometheus_rule.py

# The compose stack on podman + docker-compose 1.29 (root, Debian): the CPU image built from this
# Dockerfile, two replicas, nginx and Prometheus on 127.0.0.1 (scripts/stack.sh installs what is missing).
# NMT_STACK_PROJECT, NMT_STACK_DIR, NMT_BALANCER_PORT and NMT_PROMETHEUS_PORT run another stack beside it.
stack:
	scripts/stack.sh up

stack-down:
	scripts/stack.sh down

# A rolling restart of the replicas that fails no call: each drained (podman restart -t 30), each back in nginx before
# the next stops. A plain `docker restart` through podman's Docker API kills a replica at once.
stack-restart:
	scripts/stack.sh restart

# Load, rolling restarts and a scale-up through a stack of its own project and ports, then its `down`
# (tests/test_stack.py); skipped where no container can run, with podman's reason.
stack-test:
	$(PYTHON) -m pytest -m container tests/test_stack.py

# On a machine with an NVIDIA GPU, after `make install` with onnxruntime-gpu: the tests marked gpu; the shipped fp32
# dir's self-check on CUDA (against the CPU it was exported on) and a fresh fp32 export's parity with PyTorch there;
# then the engine (fp32 and fp16; the fp16 dir is exported into artifacts/de-en-small/onnx-fp16 with its parity
# report) and the server on CUDA, each result naming the GPU; last, the decoder step node by node on CUDA (the fp32
# self-attention runs on the CPU provider there: how much of a step it and its copies take). CTranslate2's CUDA build is not a peer here (it needs CUDA 12 libraries).
gpu-check:
	$(PYTHON) -m pytest -m gpu -rs
	nmt-parity artifacts/de-en-small/onnx-fp32
	nmt-export artifacts/de-en-small --out $${TMPDIR:-/tmp}/nmt-gpu-check-fp32 --precision fp32
	nmt-bench --models default,base --precisions fp32,fp16 --no-ct2 --torch-device cuda --batches 1,8,32,128 --threads 1 \
		--open-loop-seconds 0 --metrics-cost-repeats 0 --out bench/results/engine-gpu.md
	nmt-load-report --precisions fp32,fp16 --concurrency 1,8,32,128 --point-seconds 10 --overload-seconds 0 \
		--sigterm-after 0 --soak-seconds 0 --out bench/results/load-gpu.md
	nmt-step-profile --model-dir artifacts/de-en-small/onnx-fp32 --batches 1,8,32,128 --out bench/results/step-profile-gpu.md
