# The two set-up commands of the README: `make verify` (the main job) and `make test`.
# Both create .venv on first use. torch: an importable torch (a GPU machine's CUDA build, say)
# is kept via --system-site-packages; otherwise torch==2.13.0, the CPU wheel, is installed
# before the project so pip never resolves an unpinned torch to a multi-GB CUDA build.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.epkit-installed
JOBS    ?= 2
# The GPU kernels are Triton (epkit/triton): CI runs them in Triton's interpreter, so the set-up
# pins the version they are tested with, unless a Triton is importable already (a GPU machine's
# torch brings the one it was built with, which is then kept).
TRITON  ?= triton==3.9.0

.PHONY: setup verify test test-fast bench simulate build clean docs

setup: $(STAMP)

$(STAMP): pyproject.toml
	@if [ ! -x $(VPY) ]; then \
	  if $(PY) -c 'import torch' 2>/dev/null; then \
	    echo "epkit: keeping the torch already installed ($$($(PY) -c 'import torch; print(torch.__version__)'))"; \
	    $(PY) -m venv --system-site-packages $(VENV); \
	  else \
	    $(PY) -m venv $(VENV); \
	  fi; \
	fi
	@$(VPY) -c 'import torch' 2>/dev/null || $(VPY) -m pip install -q "torch==2.13.0"
	@$(VPY) -c 'import triton' 2>/dev/null || $(VPY) -m pip install -q "$(TRITON)"
	$(VPY) -m pip install -q -e ".[test,plot,frameworks]"
	$(VPY) -c 'import epkit.ops' && echo "epkit: C++ extension built"
	@touch $(STAMP)

verify: $(STAMP)
	$(VENV)/bin/epkit verify $(ARGS)

test: $(STAMP)
	$(VPY) -m pytest -n $(JOBS) $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/epkit bench $(ARGS)

simulate: $(STAMP)
	$(VENV)/bin/epkit simulate $(ARGS)

# The docs' quoted outputs and figures, regenerated: every command output a doc quotes between
# <!-- output: CMD --> markers is rerun into it (tests/docs/test_doc_outputs.py checks them), then
# the figures of docs/benchmarks.md come from scripts/docs_figures.sh, where that script exists.
docs: $(STAMP)
	$(VPY) tests/docs/doc_outputs.py
	@if [ -f scripts/docs_figures.sh ]; then bash scripts/docs_figures.sh; \
	else echo "make docs: no scripts/docs_figures.sh yet: the figures are left as they are"; fi

clean:
	rm -rf $(VENV) build *.egg-info
