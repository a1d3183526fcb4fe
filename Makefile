# The two commands a newcomer runs:  `make run`  (set up, then train the embedded default)
#                                    `make test` (set up, then run the whole suite; CI runs this)
# `make test-fast` skips the slow real-component tests (vLLM on CPU, the Tinker emulator).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.headrace-installed

.PHONY: setup run test test-fast
setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

run: setup
	$(VENV)/bin/headrace run

test: setup
	$(VENV)/bin/python -m pytest -q

test-fast: setup
	$(VENV)/bin/python -m pytest -q -m "not slow"
