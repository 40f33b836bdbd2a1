# Two entry points: `make run` (the main job) and `make test` (the suite).
# Override TORCH_SPEC for a CUDA build, e.g. make run TORCH_SPEC="torch==2.13.0 --index-url ..."
PY ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.ditsp-installed

.PHONY: setup run test test-bitwise bench clean train-tiny

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# The main job: degrade a short clip of a photograph the training never saw (out/input.mp4, 64x48, and its clean
# original out/clean/, 128x96), restore it at 2x with the small restorer the package ships (--model tiny, its
# default; trained in the repo by `make train-tiny`) on 2 local ranks in 9-frame windows, write the video, a picture
# of input vs output frames and a per-stage timeline, one of input / restored / bicubic / clean original with PSNR
# and SSIM (out/upscale-reference.png), the quality figures against bicubic, and check the frames against one device.
run: $(STAMP)
	mkdir -p out
	$(BIN)/python -m ditsp.train.heldout out/input.mp4 out/clean --size 128x96 --frames 21 --fps 12 --overwrite
	$(BIN)/ditsp upscale out/input.mp4 -o out/restored.mp4 --sp 2 --window-frames 9 --overlap 4 --reference out/clean \
		--overwrite --plot out/upscale.png --check --deterministic --no-progress

# The small restorer the package ships (ditsp/models/seedvr2/trained/tiny): its VAE (2x space, no time compression)
# written as a lossless space-to-depth of the released structure (ditsp/train/vae_start.py; a VAE trained from
# scratch on one core reached 29 dB, too little to beat bicubic), then the tiny DiT trained on the one-step
# restoration objective against it, on 9-frame clips as the job's windows, in two stages (the second from the
# first's weights at a lower learning rate). Reproducible from TINY_SEED; about 70 minutes on one CPU core (the
# training runs one compute thread).
TINY_SEED ?= 0
TINY_DIT_STEPS ?= 600
TINY_OUT ?= out/train-tiny
TINY_SHIPPED := ditsp/models/seedvr2/trained/tiny
train-tiny: $(STAMP)
	$(BIN)/python -m ditsp.train.vae_start $(TINY_OUT)/vae/vae.safetensors
	$(BIN)/ditsp train --objective dit --steps $(TINY_DIT_STEPS) --batch 2 --lr 1e-3 --frames 9 --seed $(TINY_SEED) \
		--size 64x64,64x64,64x64,128x96 --vae $(TINY_OUT)/vae/vae.safetensors --out $(TINY_OUT)/dit1 \
		--checkpoint-every 50 --resume
	$(BIN)/ditsp train --objective dit --steps $(TINY_DIT_STEPS) --batch 2 --lr 3e-4 --frames 9 \
		--seed $$(( $(TINY_SEED) + 1 )) --dit $(TINY_OUT)/dit1/dit.safetensors \
		--size 64x64,64x64,64x64,128x96 --vae $(TINY_OUT)/vae/vae.safetensors --out $(TINY_OUT)/dit \
		--checkpoint-every 50 --resume
	mkdir -p $(TINY_SHIPPED)
	cp $(TINY_OUT)/vae/vae.safetensors $(TINY_OUT)/dit/dit.safetensors $(TINY_SHIPPED)/
	cp $(TINY_OUT)/dit1/loss.png $(TINY_SHIPPED)/dit-loss.png
	cp $(TINY_OUT)/dit/loss.png $(TINY_SHIPPED)/dit-loss-2.png

# The tests that assert equal bits across SP degrees (marked `bitwise`) run again under another kernel
# set on this machine. On a CPU with more than AVX2 that is the AVX2 kernels an AVX2-only CPU runs; on an
# AVX2 CPU those are its native kernels already, so it is MKL's compatible code path with ATen's default
# (non-SIMD-dispatched) kernels instead, whose GEMM rows depend on the row count for most counts. The
# guarantee is structural (docs/determinism.md), so it must hold under every set; `make test-bitwise`
# runs all three.
KERNELS_AVX2 := MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
KERNELS_COMPAT := MKL_CBWR=COMPATIBLE ONEDNN_MAX_CPU_ISA=SSE41 ATEN_CPU_CAPABILITY=default
BITWISE := $(BIN)/python -m pytest -q -p no:cacheprovider -m bitwise tests

# Both phases always run, and the target fails if either failed: a failure in the suite must not hide one in
# the bitwise tests. Ctrl-C or a TERM stops both.
test: $(STAMP)
	@trap 'exit 130' INT TERM; suite=0; bitwise=0; \
	echo "the suite: $(BIN)/python -m pytest -q"; \
	$(BIN)/python -m pytest -q || suite=$$?; \
	if [ "$$($(BIN)/python -c 'import torch; print(torch.backends.cpu.get_cpu_capability())')" = AVX2 ]; then \
		echo "bitwise tests under $(KERNELS_COMPAT) (native kernels are AVX2)"; env $(KERNELS_COMPAT) $(BITWISE) || bitwise=$$?; \
	else \
		echo "bitwise tests under $(KERNELS_AVX2)"; env $(KERNELS_AVX2) $(BITWISE) || bitwise=$$?; \
	fi; \
	if [ $$suite -ne 0 ] || [ $$bitwise -ne 0 ]; then \
		echo "make test: FAILED (the suite: exit $$suite; the bitwise tests: exit $$bitwise)"; exit 1; \
	fi

# The bitwise tests alone, under the three kernel sets (a quick check of a kernel-related change).
test-bitwise: $(STAMP)
	$(BITWISE)
	env $(KERNELS_AVX2) $(BITWISE)
	env $(KERNELS_COMPAT) $(BITWISE)

# Benchmarks (minutes, not part of the tests): tables and plots under benchmarks/results. They run under
# the CPU allocator policy their figures were measured with (docs/configuration.md: DITSP_CPU_MALLOC_RESTART).
bench: export DITSP_CPU_MALLOC_RESTART = 1
bench: $(STAMP)
	$(BIN)/ditsp bench forward
	$(BIN)/ditsp bench attention --sp 4 --seq 4096 --heads 8 --head-dim 64 | tee benchmarks/results/attention.txt

clean:
	rm -rf $(VENV) out .pytest_cache .hypothesis

# The GPU acceptance run (docs/gpu.md): on a machine with a GPU and torch, no network and no venv. Installs
# ditsp without its dependencies (or runs it from the tree when that fails), then runs every step of
# benchmarks/gpu/ under its time budget (about 6 minutes on an H200) into
# $(GPU_CHECK_OUT)/<date>-<device>/results.{json,md}, written as each row finishes. Without a GPU it runs
# the same steps at tiny sizes on the CPU (a dry run; the suite runs it too, tests/test_gpu_check.py).
GPU_PY ?= python3
GPU_CHECK_OUT ?= benchmarks/results/gpu
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check:
	timeout 120 $(GPU_PY) -m pip install -q --no-deps --no-build-isolation --no-index -e . \
		|| echo "gpu-check: pip install failed; running ditsp from the tree"
	PYTHONUNBUFFERED=1 PYTHONPATH=$(CURDIR) $(GPU_PY) -m benchmarks.gpu.check --out $(GPU_CHECK_OUT) $(GPU_CHECK_ARGS)
