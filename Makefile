# `make run` and `make test` do all set-up on a fresh machine: create .venv, install, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
VENV_READY := $(VENV)/.ready
# given on purpose: $(shell) does not see a variable set on make's command line (make run MOE_WORKBENCH_RUNTIME=cpu)
RUNTIME := $(shell MOE_WORKBENCH_RUNTIME='$(MOE_WORKBENCH_RUNTIME)' $(PYTHON) packaging/select_runtime.py)
ifeq ($(RUNTIME),)
ifneq ($(MAKECMDGOALS),clean)
$(error packaging/select_runtime.py chose no onnxruntime build (why: the line above))
endif
endif
STAMP := $(VENV)/.installed-$(RUNTIME)
# A .venv made with another Python (make PYTHON=python3.12 … after a make with python3.14, or python3 upgraded since)
# is made afresh: pip installed into the old one, where the wheels the runtime was chosen for may not exist.
VENV_PYTHON := $(shell sed -n 's/^version *= *\([0-9]*\.[0-9]*\).*/\1/p' $(VENV)/pyvenv.cfg 2>/dev/null)
ifneq ($(VENV_PYTHON),)
ifneq ($(VENV_PYTHON),$(shell $(PYTHON) -c 'import sys; print(*sys.version_info[:2], sep=".")'))
$(VENV_READY): FORCE
endif
endif

.PHONY: run test install desktop clean FORCE

run: $(STAMP)
	$(PY) -m app

# MALLOC_MMAP_THRESHOLD_=0: every malloc its own mapping, unmapped when freed (glibc), so a read of freed memory (a
# ctypes stand-in copying from an address whose array is gone) crashes every run, not now and then as it did in CI
test: $(STAMP)
	MALLOC_MMAP_THRESHOLD_=0 $(PY) -m pytest -q

install: $(STAMP)

# Made last: a creation cut short (python there, pip not yet) leaves none, and the next make starts the venv afresh.
$(VENV_READY):
	$(PYTHON) -m venv --clear $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	touch $@

# onnxruntime and onnxruntime-gpu share one module, as cupy-cuda12x and cupy-cuda13x do: remove the builds this
# runtime must not have. The stamps go first, so that an install cut short after the removal is redone by the next make.
CONFLICTS_cpu := onnxruntime-gpu
CONFLICTS_cuda12 := onnxruntime cupy-cuda13x
CONFLICTS_cuda13 := onnxruntime cupy-cuda12x

$(STAMP): pyproject.toml packaging/select_runtime.py $(VENV_READY)
	rm -f $(VENV)/.installed-*
	$(PY) -m pip uninstall --quiet -y $(CONFLICTS_$(RUNTIME)) 2>/dev/null || true
	$(PY) -m pip install --quiet -e ".[$(RUNTIME),test]"
	touch $(STAMP)

# The menu entry and icon for this checkout's .venv, in the user's data folder (XDG_DATA_HOME, else ~/.local/share):
# the packaged entry runs moe-workbench from PATH, which make's .venv is not on. Exec's program is quoted, as the Desktop
# Entry specification asks of a path with a space; TryExec takes a plain path.
DATA_HOME := $(or $(XDG_DATA_HOME),$(HOME)/.local/share)

desktop: $(STAMP)
	install -D -m 644 resources/moe-workbench.svg $(DATA_HOME)/icons/hicolor/scalable/apps/moe-workbench.svg
	mkdir -p $(DATA_HOME)/applications
	sed -e 's|^Exec=moe-workbench|Exec="$(abspath $(VENV))/bin/moe-workbench"|' \
	    -e 's|^TryExec=moe-workbench|TryExec=$(abspath $(VENV))/bin/moe-workbench|' \
	    packaging/moe-workbench.desktop > $(DATA_HOME)/applications/moe-workbench.desktop

clean:
	rm -rf $(VENV)
