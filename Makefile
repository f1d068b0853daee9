# The two commands a new user runs: `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The .pyc are written by the interpreter on first import, into this venv and src/: pip's
# compile step would write them for all ~16,000 files, one after another (72 of the 144 s of
# the test install here), of which ~4,100 are ever imported. They must be written: where
# PYTHONDONTWRITEBYTECODE is set (it is on this machine) nothing writes them, and every
# process compiles torch's modules again (a clean-clone suite took 1009 s of pytest without
# them, 842 s with), so make's commands run with it cleared.
export PYTHONDONTWRITEBYTECODE =
# torch comes from pip, which may be configured to take it from a wheel on local disk (and
# capped at a version: that configuration is the machine's); uv (pinned in constraints.txt)
# installs the rest from the same sources (tools/uv_install.py hands pip's over): the test
# install took 13 s here in all, against 42 s with pip alone. Neither compiles .pyc.
PIP    := $(PY) -m pip install --disable-pip-version-check -q --no-compile -c constraints.txt
UV     := $(PY) tools/uv_install.py -q -c constraints.txt
# make test: pytest-xdist workers, one test file at a time each (module fixtures stay one
# run per file), the longest files first (tests/conftest.py LONGEST_FIRST). One worker more
# than there are cores: the suite's jobs wait too (timeouts, rendezvous, a host's link down),
# and the extra worker fills those gaps (2 cores here: 3 workers 507 s of pytest, idle cores
# 25 core-s; 2 workers 546-571 s, idle ~100 core-s).
PYTEST_WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))

.PHONY: run test test-fresh fuzz lint install install-test bench clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch uv
	$(UV) -e .
	touch $@

# hf: transformers, so that tests/train/test_hf_task.py (a model from another library as a
# TrainTask) runs rather than skips; ~13 s and ~170 MB on top of the test tools
# peft: so that tests/recipes/ (the causal-LM recipe's LoRA runs) run rather than skip;
# ~3 s and ~15 MB more (peft + accelerate)
# tensorboard: so that tests/monitor/test_tensorboard.py reads event files back rather than
# skips; ~7 s and ~58 MB more
# one install of the package and its test extras, so it also stands for `install`
$(VENV)/.installed-test: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) torch uv
	$(UV) -e '.[test,hf,peft,tensorboard]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

## make run: set up and run the main job (SimpleNet on digits, DDP over 2 processes)
run: install
	$(VENV)/bin/disttrain run

## make test: set up and run the whole suite (multi-process tests included)
test: install-test
	$(VENV)/bin/ruff check src tests benchmarks examples tools
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

## make test-fresh: the suite with every `disttrain` command a new interpreter, none forked
## from the warm one of tests/warm_cli.py (slower; the same tests)
test-fresh: install-test
	DISTTRAIN_TEST_FRESH=1 $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

## make fuzz: the property tests with new random inputs and 10x the examples, for exploring
## (make test runs a fixed set); keep an input it finds as an @example of its test
fuzz: install-test
	$(PY) -m pytest -q --hypothesis-profile=fuzz tests/cli/test_fuzz.py tests/diagnose/test_properties.py

lint: install-test
	$(VENV)/bin/ruff check src tests benchmarks examples tools

## make bench: the Trainer beside a plain DDP loop, then 1 vs 2 processes (docs/performance.md)
bench: install
	$(VENV)/bin/disttrain bench overhead --rounds 3
	$(VENV)/bin/disttrain bench scaling --rounds 3

clean:
	rm -rf $(VENV) runs .pytest_cache
