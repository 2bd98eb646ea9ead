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
# megatron-core, the newest (tests/integrations runs its real MoE layer). 0.17 and later declare
# Requires-Python >=3.12, so on Python 3.11 pip will not install them, yet 0.19.2's cp311 wheel
# installs and runs here. The set-up therefore installs it by hand-picked flags, said plainly:
#   pip install --no-deps --ignore-requires-python megatron-core==0.19.2
# (--no-deps: its dependencies, numpy and packaging, come with epkit's; pyproject.toml's
# frameworks extra pins it only for 3.12+). The previous pin, 0.16.1 (the newest that declares
# 3.11), is kept beside it in .venv/megatron-core-0.16.1 (pip --target, not on the path):
# tests/integrations/test_megatron_versions.py runs the layer comparison against it too.
MEGATRON     ?= megatron-core==0.19.2
MEGATRON_OLD ?= megatron-core==0.16.1

.PHONY: setup verify test test-fast bench simulate build clean docs

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
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
	$(VPY) -m pip install -q --no-deps --ignore-requires-python "$(MEGATRON)"
	$(VPY) -m pip install -q --no-deps --upgrade --target $(VENV)/megatron-core-0.16.1 "$(MEGATRON_OLD)"
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
