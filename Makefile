# Two entry points for a fresh machine (see README.md):
#   make train   - create .venv, install, run rp-train on its embedded default job
#   make test    - create .venv, install, lint + type-check, the whole test suite while the NVMe
#                  tier's aio op and the AVX2 CPU Adam build beside it (what CI runs)
#   make test-fast - the edit-run loop: plan, config, counters, device and optimizer unit tests
VENV ?= .venv
PY := $(VENV)/bin/python
# DeepSpeed JIT-builds its CPU Adam once; keep the build outside the checkout so every clone and
# CI run on this machine reuses it, and keep the venv's ninja first on PATH (switching ninjas
# triggers full rebuilds).
export TORCH_EXTENSIONS_DIR ?= $(HOME)/.cache/rp_engine/torch_extensions
export PATH := $(abspath $(VENV))/bin:$(PATH)

.PHONY: train test test-fast test-avx2 lint install aio

# Pure functions and small units, seconds each: run these while editing (the tiers: README.md).
FAST_TESTS := tests/plan tests/unit

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[dev,hf]"
	touch $@

# The NVMe tier's fast I/O engine: DeepSpeed's aio op needs libaio-dev (installed here when we
# are root and can), and its first JIT build takes minutes (~200 s on 2 cores): built once into
# the shared cache. Not part of install (`make train` never asks for NVMe): a run whose NVMe tier
# finds it unbuilt starts this build in the background and uses the built-in engine meanwhile
# (RP_ENGINE_AIO_BUILD=0 turns that off); `make test` builds it beside the first tests, the tests
# that exercise it wait for it. (Not `$(MAKE) aio` there: `make -n test` would run that line.)
# Never fails: without it the tier uses its built-in O_DIRECT engine.
AIO_BUILD = if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! dpkg -s libaio-dev >/dev/null 2>&1; then \
		apt-get install -y -q libaio-dev >/dev/null 2>&1 || \
		echo "rp_engine: could not install libaio-dev; the NVMe tier will use its built-in engine"; \
	fi; \
	$(PY) -m rp_engine.storage.build_aio || true
aio: $(VENV)/.installed
	@$(AIO_BUILD)

install: $(VENV)/.installed

train: $(VENV)/.installed
	$(VENV)/bin/rp-train

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check rp_engine tests benchmarks
	$(VENV)/bin/ruff format --check rp_engine tests benchmarks
	$(VENV)/bin/mypy rp_engine

# The native ops build in the background while lint and the first tests run (tests/support/
# prebuild.py: each test that needs one waits for it); then the suite, then the AVX2 leg.
PREBUILD := $(abspath .prebuild)
test: $(VENV)/.installed
	@rm -rf $(PREBUILD) && mkdir -p $(PREBUILD)
	@( $(AIO_BUILD); echo $$? > $(PREBUILD)/aio.done ) > $(PREBUILD)/aio.log 2>&1 &
	@( $(PY) tests/support/avx2_cpu_adam.py --build-only > $(PREBUILD)/avx2.log 2>&1; \
		echo $$? > $(PREBUILD)/avx2.done ) &
	$(MAKE) --no-print-directory lint
	RP_TESTS_PREBUILD=$(PREBUILD) $(VENV)/bin/pytest -q -ra --durations=15
	RP_TESTS_PREBUILD=$(PREBUILD) $(PY) tests/support/prebuild.py wait aio avx2
	@cat $(PREBUILD)/aio.log
	$(MAKE) --no-print-directory test-avx2

# DeepSpeed's CPU Adam and torch's kernels as on an AVX2 machine (no AVX-512), also on one that
# has AVX-512: the tests that compare the engine's weights with plain PyTorch's must hold on
# both (the AVX2 CPU Adam is built once into its own cache folder, about 2 minutes).
AVX2_TESTS := tests/engine/test_async_optimizer.py tests/engine/test_iteration_overlap.py \
	tests/unit/test_reference_slack.py tests/engine/test_compensation_combos.py \
	tests/engine/test_module_models.py tests/interop/test_module_parity.py
test-avx2: $(VENV)/.installed
	$(PY) tests/support/avx2_cpu_adam.py -q -p no:cacheprovider $(AVX2_TESTS)

test-fast: $(VENV)/.installed
	$(VENV)/bin/pytest -q -x $(FAST_TESTS)
