# Two entry points: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs when missing.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# torch pinned to the local CPU build so pip never pulls a newer CUDA release.
TORCH  := torch==2.13.0
PYTEST_ARGS ?=
SGLANG_IMPORTS := orjson psutil pybase64 requests packaging pillow starlette tqdm IPython \
	aiohttp pydantic triton

.PHONY: test demo install system-deps bench clean

# The compiled index core is built by the editable install: rebuild when its source changes.
$(STAMP): pyproject.toml setup.py kvevents/index/_core.pyx kvevents/index/_tables.pxi
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -e '.[dev,connector]'
	# SGLang's own publisher for tests/test_sglang.py: the wheel without its (GPU)
	# dependency tree, plus what its kv_events module imports (about 100 s).
	$(BIN)/python -m pip install -q --no-deps sglang==0.5.23
	$(BIN)/python -m pip install -q $(SGLANG_IMPORTS)
	@touch $(STAMP)

install: $(STAMP)

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

test: $(STAMP) system-deps
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/kvevents demo

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_publisher.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache kvevents/index/_core.c kvevents/index/*.so
