# The two commands a newcomer needs (see README):
#   make demo   set up .venv and run the demo on simulated GPUs
#   make test   set up .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0

.PHONY: venv demo test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU wheel of torch first: a bare `torch` requirement pulls a multi-GB CUDA build.
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e '.[train,test,plot,lightning,hf,fp8]' "$(TORCH)"
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/greenctl demo

test: venv
	$(PY) -m pytest -q

bench: venv
	for b in bench/bench_*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
