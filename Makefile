# The two commands of the README: `make demo` (the main job) and `make test`.
VENV ?= .venv
OPENBLAS := /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
RUN := $(if $(wildcard $(OPENBLAS)),LD_PRELOAD=$(OPENBLAS) ,)

.PHONY: setup demo test benchmark
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py scripts/setup.sh $(wildcard csrc/*)
	VENV=$(VENV) bash scripts/setup.sh
	touch $@

demo: setup
	$(RUN)$(VENV)/bin/veloxquant demo $(ARGS)

test: setup
	$(RUN)$(VENV)/bin/python -m pytest -q $(ARGS)
