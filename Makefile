# The two set-up commands of the README, and their parts.
PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test serve corpus

# torch first and pinned: anything that pulls an unpinned torch would fetch GB of CUDA wheels.
install:
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'

test: install
	$(PYTHON) -m pytest -q

serve:
	@echo "nmt-serve: the gRPC service on the shipped model lands with issue 5 (serving); see README.md." >&2
	@exit 2

# The real German->English corpus (needs the Debian package trans-de-en).
corpus: install
	nmt-corpus --out data/corpus
