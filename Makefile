# Every target creates .venv on first use; nothing is installed outside it.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed

.PHONY: install bytecode native interpreted demo test lint bench fuzz sim clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Bytecode for our own packages, written explicitly: an editable install leaves them
# uncompiled, and where PYTHONDONTWRITEBYTECODE is set (as on our CI machine) every process
# would compile them again at start (~0.1-0.2 s each; the tests start hundreds). Up-to-date
# files are skipped; an edited file is compiled again here.
PACKAGES := engine wal cluster sim bench tests
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q $(PACKAGES) > /dev/null

# The engine and the simulation compiled with mypyc (build_native.py):
# the same sources as C extension modules beside them, which Python imports first. Rebuilt when
# any source in those packages changes (~2.5 min); each package refuses to import a compiled
# module older than its source. `make interpreted` removes them all.
# Without a C compiler or Python's headers (a fresh machine may have neither; the venv's
# interpreter is asked: `build_native.py --can-build`) the build is skipped with a warning and
# everything runs interpreted: the same decisions, slower (README, "Compiled build"); `make
# test` then does not require the compiled modules. NATIVE=required (what .ci/run passes)
# fails instead. A compiler that is there but fails always fails the build.
NATIVE_STAMP := build/native/.built
$(NATIVE_STAMP): $(STAMP) build_native.py $(wildcard engine/*.py sim/*.py) wal/route.py
	@if $(BIN)/python build_native.py --can-build; then \
		echo "$(BIN)/python build_native.py"; \
		$(BIN)/python build_native.py && mkdir -p $(dir $@) && touch $@; \
	elif [ "$(NATIVE)" = required ]; then \
		echo "error: NATIVE=required, and the compiled build cannot be made" >&2; exit 1; \
	else \
		echo "warning: the compiled build is skipped; everything runs interpreted (the same" \
			"decisions, slower). For it: gcc and the Python headers (Debian/Ubuntu: apt-get" \
			"install gcc python3-dev)" >&2; \
		rm -f engine/*.so sim/*.so wal/*.so $@; \
	fi

native: $(NATIVE_STAMP)

interpreted:
	rm -f engine/*.so sim/*.so wal/*.so tickwheel_native__mypyc*.so $(NATIVE_STAMP)  # (the last: older builds')

# A node and a worker on a fresh temporary data directory, four sample jobs, their runs and logs.
demo: $(STAMP) bytecode native
	$(BIN)/python -m cluster.demo

# TICKWHEEL_EXPECT_NATIVE: tests/test_native.py checks that the compiled modules are the ones
# under test (not where the build was skipped for want of a compiler: no stamp).
test: $(STAMP) bytecode native
	TICKWHEEL_EXPECT_NATIVE=$$(test -e $(NATIVE_STAMP) && echo 1 || echo 0) $(BIN)/pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# pytest-benchmark micro-benchmarks; the CLI suites (`tickwheel bench wheel`) print the figures.
bench: $(STAMP) bytecode native
	$(BIN)/pytest -q bench --benchmark-only --benchmark-columns=min,mean,ops,rounds

# The property and state-machine tests with fresh random examples, ten rounds (about ten
# minutes): the engine's, and those of the store, the wire codec, the watchdog and payload
# results.
# (recursive: the grep runs when fuzz does, not at every make)
FUZZ_TESTS = tests/engine $(shell grep -l "from hypothesis" tests/wal/*.py tests/cluster/*.py)
fuzz: $(STAMP) bytecode native
	for i in 1 2 3 4 5 6 7 8 9 10; do \
		HYPOTHESIS_PROFILE=fuzz $(BIN)/pytest -q -p no:cacheprovider $(FUZZ_TESTS) || exit 1; \
	done

# Thousands of seeds of the fault-injection simulation with every fault (a stop at the first
# broken promise prints its seed and a trace excerpt; the report lands in sim-report/), then
# every mutant, which must be caught within 200 seeds. About an hour on two cores; SIM_SEEDS,
# SIM_JOBS and SIM_HOURS size it (`make sim SIM_SEEDS=200` for a quick look).
SIM_SEEDS ?= 2000
SIM_JOBS  ?= 200
SIM_HOURS ?= 1
sim: $(STAMP) bytecode native
	$(BIN)/tickwheel sim --seeds $(SIM_SEEDS) --jobs $(SIM_JOBS) --hours $(SIM_HOURS) \
		--faults all --report sim-report
	for m in claim-after-fire no-epoch-fence no-self-fence no-redispatch report-ack-before-durable \
			lose-fire eager-catchup alo-lost retry-no-backoff unpinned amo-no-grace no-trigger \
			trigger-no-dedupe; do \
		$(BIN)/tickwheel sim --seeds 200 --jobs $(SIM_JOBS) --hours $(SIM_HOURS) \
			--faults all --mutant $$m || exit 1; \
	done

clean: interpreted
	rm -rf $(VENV) build .pytest_cache .mypy_cache .ruff_cache .hypothesis .benchmarks sim-report
	find $(PACKAGES) -name __pycache__ -type d -prune -exec rm -rf {} +
