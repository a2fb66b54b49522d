# The two commands for a fresh machine are `make demo` and `make test` (see README.md).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | md5sum | cut -c1-12)

.PHONY: setup demo test test-unit test-gpu controlplane vllm

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -e '.[engine,test]'
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
NOT_CUDA := $(if $(shell nvidia-smi -L 2>/dev/null),,not cuda and )
WALLCLOCK_LOG := tests/.wallclock-lane.log

# The three set-ups are independent (two virtualenvs, the Go build): side by side they take the
# longest one's time. The tests marked `wallclock` (simulated engines that sleep their steps, stand-in
# pods, lease durations: about 8 minutes of waiting on little CPU) run in a second pytest, with its own
# control plane and Prometheus, beside the rest; its report follows the main one.
test:
	$(MAKE) --no-print-directory -j3 --output-sync=target setup controlplane vllm
	@$(BIN)/python -m pytest tests -m "$(NOT_CUDA)wallclock" -p no:cacheprovider > $(WALLCLOCK_LOG) 2>&1 & side=$$!; \
	$(BIN)/python -m pytest tests -m "$(NOT_CUDA)not wallclock"; main=$$?; \
	wait $$side; side=$$?; \
	echo "=== the wallclock lane (pytest -m '$(NOT_CUDA)wallclock', $(WALLCLOCK_LOG)): exit $$side ==="; \
	cat $(WALLCLOCK_LOG); test $$main -eq 0 && test $$side -eq 0

test-unit: setup
	$(BIN)/python -m pytest tests -m "not integration and not cuda and not vllm"

test-gpu: setup
	$(BIN)/python -m pytest tests -m cuda
