# Two commands do all setup on a fresh machine:
#   make demo   the main job: a float16 DCGAN trained through the builder
#   make test   the test suite (creates its own venvs with pinned packages)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The core suite also runs under v1 behaviour (ref variables, Switch/Merge).
CORE_TESTS := tests/test_managers.py tests/test_builder.py tests/test_optimizer.py \
              tests/test_bad_input.py tests/test_underflow.py tests/test_npu_backend.py
PYTEST := $(PY) -m pytest -q -p no:cacheprovider

.PHONY: venv demo test test-core test-v1 bench bench-quick clean

$(VENV)/.installed: requirements/tf221.txt setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements/tf221.txt
	$(PY) -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(PY) examples/gan/dcgan.py --precision fp16 --out out/demo

test: venv
	$(PYTEST) tests
	NPU_LOSSSCALE_GRAPH_MODE=v1 $(PYTEST) $(CORE_TESTS)

test-core: venv
	$(PYTEST) $(CORE_TESTS)

bench: venv
	$(PY) benchmarks/run.py

bench-quick: venv
	$(PY) benchmarks/run.py --quick --out out/bench-quick

clean:
	rm -rf $(VENV) out .cache
