# The two commands for a fresh machine are `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

.PHONY: setup demo test test-unit test-gpu controlplane vllm

# uv installs what pip would from PyPI, in parallel: the venv (about 6 GB with torch's CUDA wheels) in
# about 15 s where pip took about 2 minutes.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q uv
	$(BIN)/uv pip install -q --python $(BIN)/python -e '.[engine,test]'
	touch $@

# The CPU kernels (paged attention, fused ops) are compiled on first use (cached by source and CPU): build them here,
# not inside the first engine a timed test or the demo starts.
setup: $(STAMP)
	$(BIN)/python -c "from kvtune_engine.attention import cpu_paged; from kvtune_engine.model import ops; cpu_paged.check(); ops.check()"

controlplane:
	bash tests/controlplane/setup.sh

# Real vLLM (CPU build) in its own venv .venv-vllm/, for the tests and benchmarks that run it.
vllm:
	bash tests/vllm/setup.sh

demo: setup
	$(BIN)/kvtune demo

# Without a GPU the CUDA-only tests are deselected (reported as such), not skipped.
NOT_CUDA := $(if $(shell nvidia-smi -L 2>/dev/null),, and not cuda)

# The three set-ups are independent (two virtualenvs, the Go build): side by side they take the
# longest one's time. The tests then run in two parts:
# 1. all but the `alone` tests, in TEST_WORKERS pytest-xdist workers, a whole file at a time (a
#    file's module fixtures stay in one worker; each worker starts its own control plane and
#    Prometheus on free ports), in the order given: the long files (tests/vllm, tests/integration)
#    first, so the short unit files fill the end (xdist's default order, the files with the most
#    tests first, leaves the long one-test files for the end, where two can queue on one worker);
# 2. the `alone` tests, in one pytest with no other test beside them: each sizes a load from a
#    measurement of this machine and judges windows of it later, and a neighbour worker's start-ups
#    moved the machine's speed in between (3 of 1057 failed in one of two fresh-clone runs when they
#    shared the workers, issue 18), or paces simulated engines in steps of a few milliseconds that a
#    busy machine delays (test_gpu_shaped_loop's docstring).
# Part 2 runs whatever part 1's result; make fails if either part failed. TEST_WORKERS defaults to
# the CPUs, at most 4; TEST_WORKERS=1 runs part 1 in one pytest too. (A third worker on two cores
# took part 1 from 1401 s to 1239-1245 s, but in one of two runs the tests that size a load at their
# start found the machine slower later: a backlog that never drained. Issue 18.)
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
XDIST := $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder,)
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target setup controlplane vllm
	status=0; \
	$(BIN)/python -m pytest $(XDIST) tests/vllm tests/integration tests/unit -m "not alone$(NOT_CUDA)" || status=$$?; \
	$(BIN)/python -m pytest tests -m "alone$(NOT_CUDA)" || status=$$?; \
	exit $$status

test-unit: setup
	$(BIN)/python -m pytest tests -m "not integration and not cuda and not vllm"

test-gpu: setup
	$(BIN)/python -m pytest tests -m cuda
