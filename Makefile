# The two commands of the README: `make demo` (the main job) and `make test`.
VENV ?= .venv
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
RUN := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS) ,)

.PHONY: setup demo test test-all benchmark
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py scripts/setup.sh $(wildcard csrc/*)
	VENV=$(VENV) bash scripts/setup.sh
	touch $@

demo: setup
	$(RUN)$(VENV)/bin/veloxquant demo $(ARGS)

# `make test` leaves out the tests marked `slow` (the long end-to-end sweeps); `make test-all` runs every test.
# Both run test files on two pytest-xdist workers, each with one OpenBLAS thread (docs/architecture.md, Tests).
PYTEST := OPENBLAS_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -n 2 --dist loadfile
test: setup
	$(RUN)$(PYTEST) -m "not slow" $(ARGS)

test-all: setup
	$(RUN)$(PYTEST) $(ARGS)
