# Works on a fresh machine with python3.11 (or any python3 >= 3.11 as PYTHON=...).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: up test lint man install clean-venv wheels
WHEELS ?= wheels

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip

# Reinstall only when the dependency list changes. `make up` needs only what running
# needs; the test tools (pytest, ruff, mypy, uv, playwright, ...) come with `make install`,
# `make lint` and `make test`.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/python -m pip install -e '.[test]'
	touch $@

install: $(VENV)/.installed-test

# `make up PORT=8611` when 8600 is taken.
PORT ?=
up: $(VENV)/.installed
	$(BIN)/gpuplane up --example$(if $(PORT), --port $(PORT))

# The linter and the type checker first (seconds), then the suite (minutes).
lint: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/mypy

# Two workers, a test file each at a time (a file's module fixtures stay in one process):
# most tests wait on real processes, so two cores run two files at once. PYTEST_WORKERS=0
# runs it in one process.
PYTEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile)

# Man pages from the argparse parsers (tests/test_install.py checks they are current).
MANDIR ?= man
MANPAGE = $(BIN)/argparse-manpage --project-name GPUPlane --manual-title "GPUPlane manual" \
	--version "$$($(BIN)/python -c 'import gpuplane; print(gpuplane.__version__)')"
man: $(VENV)/.installed-test
	mkdir -p $(MANDIR)
	$(MANPAGE) --module gpuplane.cli --function get_parser --prog gpuplane \
		--description "a control plane for training on personal and small GPU machines" \
		--output $(MANDIR)/gpuplane.1
	$(MANPAGE) --pyfile agent.py --function build_parser --prog gpuplane-agent \
		--description "the GPUPlane agent: runs jobs on this host's GPUs" \
		--output $(MANDIR)/gpuplane-agent.1
	$(MANPAGE) --pyfile mcp_server.py --function get_parser --prog gpuplane-mcp \
		--description "the GPUPlane MCP server for coding agents" \
		--output $(MANDIR)/gpuplane-mcp.1
	@echo "wrote $(MANDIR)/gpuplane.1, gpuplane-agent.1, gpuplane-mcp.1 (view: man ./man/gpuplane.1)"

# An offline install kit: GPUPlane and every dependency as wheels for this Python and
# platform (docs/deploy.md). On the target: pip install --no-index --find-links wheels gpuplane
wheels: | $(BIN)/python
	$(BIN)/python -m pip wheel --wheel-dir $(WHEELS) .
	@echo "wrote $(WHEELS)/ (copy it to the target; see docs/deploy.md)"
