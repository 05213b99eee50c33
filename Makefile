# The two commands a newcomer needs (see README):
#   make demo   set up .venv and run the demo on simulated GPUs
#   make test   set up .venv and run the test suite
# and while working: make test-fast (the tests without a daemon subprocess, under 90 s on 2 cores)
# and, before a commit:
#   make check  lint (ruff), format check (ruff format) and type check (mypy)
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# torch's CPU build: its +cpu version exists only on PyTorch's CPU index (or as a local
# wheel), so it can never resolve to the multi-GB CUDA build. On a GPU machine: TORCH=torch==2.13.0
TORCH  ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu

# Python may write its bytecode caches here even where the environment says not to
# (PYTHONDONTWRITEBYTECODE=1): pytest's rewritten test modules are cached beside them, and
# without the cache every xdist worker rewrites every test module's asserts at each run
# (about 8 s of CPU a worker here, a tenth of make test-fast's time).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv demo test test-fast check bench clean nvml-stub

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first: a bare `torch` requirement pulls a multi-GB CUDA build.
	# From the indexes pip already knows (a local wheel), else from PyTorch's CPU index.
	$(PY) -m pip install -q "$(TORCH)" 2>/dev/null || $(PY) -m pip install -q "$(TORCH)" --extra-index-url "$(TORCH_INDEX)"
	$(PY) -m pip install -q -e '.[train,test,plot,lightning,hf,fp8,dev]' "$(TORCH)"
	# An editable install's finder runs after Python's path finder, so a folder named greend
	# in the current directory (the checkout, seen from the folder that holds it) would
	# shadow the package as an empty namespace package: put greend's finder first.
	$(PY) -c 'import shutil, sysconfig; shutil.copy(".ci/greend-editable-first.pth", sysconfig.get_paths()["purelib"])'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/greenctl demo

test: venv nvml-stub
	$(PY) -m pytest -q

# Four workers on two cores: most of these tests' time is waiting (sockets, timers,
# subprocesses), not computing; -n 4 took 72 s where -n 2 took 92 s (2 cores, idle, 1,106 tests).
test-fast: venv nvml-stub
	$(PY) -m pytest -q -n 4 -m "not e2e and not slow"

# A stand-in for libnvidia-ml.so.1 (tests/nvml_stub/nvml_stub.c): the tests run the
# real pynvml on it with LD_LIBRARY_PATH=build/nvml_stub. Tests build it on demand too.
NVML_STUB := build/nvml_stub/libnvidia-ml.so.1

nvml-stub: $(NVML_STUB)

$(NVML_STUB): tests/nvml_stub/nvml_stub.c
	mkdir -p $(dir $@)
	$(CC) -shared -fPIC -O2 -Wall -Wextra -Werror -o $@ $< -lpthread

# mypy cannot follow setuptools' editable finder, which maps greend.probes and
# greend.policies onto the top-level folders; it checks a tree of symlinks in the
# installed shape instead (build/typecheck/greend).
TYPECHECK := build/typecheck

check: venv
	$(VENV)/bin/ruff check greend probes policies tests bench
	$(VENV)/bin/ruff format --check greend probes policies tests bench
	rm -rf $(TYPECHECK) && mkdir -p $(TYPECHECK)/greend
	for f in greend/*; do ln -s "$$PWD/$$f" $(TYPECHECK)/greend/; done
	ln -s "$$PWD/probes" $(TYPECHECK)/greend/probes
	ln -s "$$PWD/policies" $(TYPECHECK)/greend/policies
	cd $(TYPECHECK) && $(CURDIR)/$(VENV)/bin/mypy --config-file $(CURDIR)/pyproject.toml -p greend

bench: venv
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
