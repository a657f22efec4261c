# The two commands a new machine needs (see README): `make demo` and `make test`.
# Each builds .venv on first use (scripts/setup_env.sh), then runs.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: demo test setup
setup: $(STAMP)

$(STAMP): scripts/setup_env.sh pyproject.toml
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m moe_grouped_decode demo

test: $(STAMP)
	$(PY) -m pytest -q -rs tests
