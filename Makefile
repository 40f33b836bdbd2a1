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

# The main job: plan a 720p 81-frame request at SP=4 (with its picture), then run it on
# 4 local ranks on a reduced-width NaDiT of the 3B structure and check parity with one device.
run: $(STAMP)
	mkdir -p out
	$(BIN)/ditsp plan --resolution 1280x720 --frames 81 --sp 4 --plot out/plan-720p-sp4.png
	$(BIN)/ditsp run --model small --layers 4 --resolution 1280x720 --frames 81 --sp 4 --check

test: $(STAMP)
	$(BIN)/python -m pytest -q

# Benchmarks (minutes, not part of the tests): tables and plots under benchmarks/results.
bench: $(STAMP)
	$(BIN)/ditsp bench forward
	$(BIN)/ditsp bench attention --sp 4 --seq 4096 --heads 8 --head-dim 64 | tee benchmarks/results/attention.txt

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis
