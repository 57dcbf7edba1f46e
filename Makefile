# Works on a fresh machine with python3.11 (or any python3 >= 3.11 as PYTHON=...).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: up test man install clean-venv wheels
WHEELS ?= wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# Reinstall only when the dependency list changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

install: $(VENV)/.installed

up: $(VENV)/.installed
	$(BIN)/gpuplane up --example

test: $(VENV)/.installed
	$(BIN)/python -m pytest

man: $(VENV)/.installed
	mkdir -p man
	$(BIN)/argparse-manpage --module gpuplane.cli --function get_parser --prog gpuplane \
		--project-name GPUPlane --version "$$($(BIN)/python -c 'import gpuplane; print(gpuplane.__version__)')" \
		--description "a control plane for training on personal and small GPU machines" \
		--manual-title "GPUPlane manual" \
		--output man/gpuplane.1
	@echo "wrote man/gpuplane.1 (view: man ./man/gpuplane.1)"

# An offline install kit: GPUPlane and every dependency as wheels for this Python and
# platform (docs/deploy.md). On the target: pip install --no-index --find-links wheels gpuplane
wheels: | $(BIN)/python
	$(BIN)/python -m pip wheel --wheel-dir $(WHEELS) .
	@echo "wrote $(WHEELS)/ (copy it to the target; see docs/deploy.md)"
