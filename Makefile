# Set-up commands that work on a fresh machine: both create or refresh .venv themselves.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv test lint demo demo-lm bench clean

$(STAMP): pyproject.toml requirements/constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c requirements/constraints.txt -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

lint: venv
	$(PY) -m ruff check lance_ray jobs tests
	$(PY) -m mypy lance_ray

test: lint
	$(PY) -m pytest -q

demo: venv
	$(PY) -m jobs.demo

demo-lm: venv
	$(PY) -m jobs.train_lm --demo

# Each benchmark writes docs/bench/<name>.json (name the machine with
# LANCE_RAY_BENCH_MACHINE); the last line renders them into docs/performance.md.
bench: venv
	$(PY) -m jobs.bench
	$(PY) -m jobs.bench.paired
	$(PY) -m jobs.bench.reservation
	$(PY) -m jobs.bench.mixing
	$(PY) -m jobs.bench.device
	$(PY) -m jobs.bench.scaling
	$(PY) -m jobs.bench.cores
	$(PY) -m jobs.bench.performance

clean:
	rm -rf $(VENV) runs
