# rlfabric: `make demo` trains CartPole with SEED + V-trace; `make test` runs the tests.
# Both create .venv and install the project first. torch is pinned to the CPU
# wheel that lies on this machine's disk; an unpinned torch pulls a CUDA build.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export NO_MKDOCS_2_WARNING := 1

.PHONY: install demo test test-all docs lint bench-learn bench-throughput clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e '.[dev,docs,wandb,mlflow]'
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/rlfabric train examples/specs/cartpole_seed_vtrace.yaml

# The docs build first (strict: a broken link fails); test_cli checks the generated pages.
test: install docs
	$(PY) -m pytest --durations=25

# The documentation site into site/ (mkdocs.yml); strict: any warning fails.
docs: install
	$(VENV)/bin/mkdocs build --strict --quiet

test-all: install
	$(PY) -m pytest -m ''

lint: install
	$(VENV)/bin/ruff check .

bench-learn: install
	$(PY) benchmarks/learn.py

bench-throughput: install
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV) runs .pytest_cache site
