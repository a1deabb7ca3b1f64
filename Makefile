# Two commands do all setup on a fresh machine:
#   make demo   the main job: a float16 DCGAN trained through the builder
#   make test   the test matrix (creates its own venvs with pinned packages)
PYTHON ?= python3
# TF 2.21.0: the primary runtime (fast float16 matmul on this CPU).
VENV ?= .venv
PY := $(VENV)/bin/python
# TF 2.15.1: the last TF with tf.estimator, and what Horovod 0.28.1 builds against.
VENV215 ?= .venv-tf215
PY215 := $(VENV215)/bin/python
# The Horovod wheel is built once per TF version and kept outside the clone,
# so later runs (and fresh clones on the same machine) skip the ~4 min build.
WHEELS ?= $(HOME)/.cache/npu_lossscale/wheels
PIP_FLAGS := -q --disable-pip-version-check
# The core suite also runs under v1 behaviour (ref variables, Switch/Merge).
CORE_TESTS := tests/test_plan.py tests/test_managers.py tests/test_manager_api.py \
              tests/test_manager_state.py tests/test_manager_npu_bridge.py \
              tests/test_manager_checkpoints.py tests/test_builder.py tests/test_gate.py \
              tests/test_alternating.py tests/test_monitoring.py tests/test_optimizer.py \
              tests/test_bad_input.py tests/test_underflow.py tests/test_npu_backend.py \
              tests/test_features.py tests/test_shim_adapter.py tests/test_audit.py \
              tests/test_misuse.py
PYTEST_ARGS ?=
pytest = $(1) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

.PHONY: venv venv215 demo test test-fast test-v1 test-tf215 bench bench-quick soak clean help

$(VENV)/.installed: requirements/tf221.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install $(PIP_FLAGS) -r requirements/tf221.txt
	$(PY) -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation -e .
	touch $@

$(VENV215)/.installed: requirements/tf215.txt setup.py tools/build_horovod.sh
	$(PYTHON) -m venv $(VENV215)
	$(PY215) -m pip install $(PIP_FLAGS) -r requirements/tf215.txt
	bash tools/build_horovod.sh $(VENV215) $(WHEELS)
	$(PY215) -m pip install $(PIP_FLAGS) --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed
venv215: $(VENV215)/.installed

demo: venv
	$(PY) examples/gan/dcgan.py --precision fp16 --out out/demo

# The matrix: everything on TF 2.21 (v2 control flow), the core suite again
# under v1 behaviour, then everything on TF 2.15.1 (Estimator and the
# two-rank Horovod runs need it) but the benchmark runner's smoke run: `make
# bench` runs in .venv (TF 2.21) only, and on TF 2.15's slow float16 the
# smoke run alone took 100 s of the 11.5 minutes (2026-11-25).
test: test-fast test-v1 test-tf215

test-fast: venv
	$(call pytest,$(PY)) tests

test-v1: venv
	NPU_LOSSSCALE_GRAPH_MODE=v1 $(call pytest,$(PY)) $(CORE_TESTS)

test-tf215: venv215
	$(call pytest,$(PY215)) tests --ignore=tests/test_benchmarks_quick.py

bench: venv
	$(PY) benchmarks/run.py

bench-quick: venv
	$(PY) benchmarks/run.py --quick --out out/bench-quick

soak: venv
	$(PY) tools/soak.py --steps 100000

clean:
	rm -rf $(VENV) $(VENV215) out

help:
	@echo "make demo         train the float16 DCGAN through the builder (examples/gan/dcgan.py), write out/demo/"
	@echo "make test         the matrix: test-fast, then test-v1, then test-tf215 (builds both venvs)"
	@echo "make test-fast    the whole suite on TF 2.21 (.venv)"
	@echo "make test-v1      the core suite on TF 2.21 under v1 behaviour (ref variables, Switch/Merge)"
	@echo "make test-tf215   the whole suite on TF 2.15.1 (.venv-tf215): Estimator and two-rank Horovod tests"
	@echo "make venv         build .venv: tensorflow-cpu 2.21.0 (requirements/tf221.txt) and the library"
	@echo "make venv215      build .venv-tf215: tensorflow-cpu 2.15.1, Horovod 0.28.1 with Gloo, the library"
	@echo "make bench        the full benchmarks (benchmarks/run.py), results in benchmarks/"
	@echo "make bench-quick  a quick benchmark smoke run into out/bench-quick"
	@echo "make soak         a 100,000-step soak run with injected overflows (tools/soak.py)"
	@echo "make clean        remove .venv, .venv-tf215 and out/"
	@echo "make help         this list"
