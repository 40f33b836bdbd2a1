# Two entry points: `make run` (the main job) and `make test` (the suite).
# Override TORCH_SPEC for a CUDA build, e.g. make run TORCH_SPEC="torch==2.13.0 --index-url ..."
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.ditsp-installed

.PHONY: setup run test bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	mkdir -p out
	$(BIN)/ditsp plan --resolution 1920x1080 --frames 81 --sp 4 --plot out/plan-1080p-sp4.png

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
