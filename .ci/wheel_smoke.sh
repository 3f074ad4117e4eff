#!/usr/bin/env bash
# The package as a user gets it, outside the checkout: build the sdist, the wheel from the sdist, install the wheel
# (not editable) into a fresh venv that already has a torch, and check that pip kept that torch, then run
# `import dpopt`, `dpopt --help`, a short private run and `dpopt reproduce` (which needs a checkout).
#
# The fresh venv reuses .venv's torch instead of installing one (hundreds of MB): a .pth file puts a folder of
# links to torch and its own dependencies, and nothing else from .venv, on its path. pip then sees torch as installed
# (outside the venv, so it could not uninstall it) and installs dpopt's other core dependencies itself, which also
# checks that pyproject's core list is enough for `import dpopt` and `dpopt train`.
# Needs .venv with torch (make install, or make demo).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=$ROOT/.venv/bin/python
export PIP_DISABLE_PIP_VERSION_CHECK=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset PYTHONPATH
WORK=$(mktemp -d "${TMPDIR:-/tmp}/dpopt-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
step() { printf 'wheel smoke: %s\n' "$*"; }
fail() { printf 'wheel smoke: FAILED: %s\n' "$*" >&2; exit 1; }
SECONDS=0

step "build the sdist, then the wheel from it"
"$PY" -m pip install --quiet 'setuptools>=77'  # build-system.requires; no-op when .venv has it
(cd "$ROOT" && "$PY" -c "from setuptools import build_meta as b; b.build_sdist('$WORK/dist')" >"$WORK/build.log" 2>&1) \
  || { cat "$WORK/build.log"; fail "sdist"; }
SDIST=$(ls "$WORK"/dist/dpopt-*.tar.gz)
tar -xzf "$SDIST" -C "$WORK"
(cd "$WORK"/dpopt-*/ && "$PY" -c "from setuptools import build_meta as b; b.build_wheel('$WORK/dist')" >>"$WORK/build.log" 2>&1) \
  || { cat "$WORK/build.log"; fail "wheel"; }
WHEEL=$(ls "$WORK"/dist/dpopt-*.whl)
step "built $(basename "$SDIST") and $(basename "$WHEEL")"

step "a fresh venv whose only package is .venv's torch (with its dependencies)"
BASE=$("$PY" -c 'import sys; print(sys._base_executable)')
"$BASE" -m venv "$WORK/venv"
V=$WORK/venv/bin
"$PY" - "$WORK/torch" "$("$V/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" <<'EOF'
import importlib.metadata as md, os, sys
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name
links, site = sys.argv[1:]
os.makedirs(links)
seen, todo = set(), ["torch"]
while todo:  # torch's dependency closure, as installed in .venv
    name = canonicalize_name(todo.pop())
    if name in seen:
        continue
    seen.add(name)
    dist = md.distribution(name)
    todo += [r.name for r in map(Requirement, dist.requires or []) if r.marker is None or r.marker.evaluate({"extra": ""})]
    top = {f.parts[0] for f in dist.files if f.parts[0] not in ("..", "__pycache__")}
    for entry in sorted(top):
        source = dist.locate_file(entry)
        if source.exists() and not os.path.lexists(os.path.join(links, entry)):
            os.symlink(source, os.path.join(links, entry))
with open(os.path.join(site, "_torch_from_dotvenv.pth"), "w") as f:
    f.write(links + "\n")
print(f"  linked {len(seen)} distributions: {', '.join(sorted(seen))}")
EOF
TORCH_BEFORE=$("$PY" -c 'import os, torch; print(torch.__version__, os.path.realpath(torch.__file__))')
cd "$WORK"  # from here on nothing of the checkout is on the path

step "pip install the wheel (its dependencies resolved by pip, torch left as it is)"
"$V/pip" install --progress-bar off "$WHEEL" >"$WORK/install.log" 2>&1 \
  || { cat "$WORK/install.log"; fail "pip install"; }
grep '^Successfully installed' "$WORK/install.log" | sed 's/^/  /'
grep -Eq '^Successfully installed.* torch-' "$WORK/install.log" && fail "pip installed another torch"
TORCH_AFTER=$("$V/python" -c 'import os, torch; print(torch.__version__, os.path.realpath(torch.__file__))')
[ "$TORCH_AFTER" = "$TORCH_BEFORE" ] || fail "torch changed: $TORCH_BEFORE -> $TORCH_AFTER"
step "torch unchanged: $TORCH_AFTER"
"$V/python" - "$WORK/venv" <<'EOF' || fail "installed package"
import importlib.metadata as md, os, sys
import dpopt
from pip._vendor.packaging.requirements import Requirement
venv = os.path.realpath(sys.argv[1])
assert os.path.realpath(dpopt.__file__).startswith(venv + os.sep), f"dpopt imported from {dpopt.__file__}"
assert not os.path.exists(os.path.join(os.path.dirname(dpopt.__file__), "..", "experiments")), "experiments/ installed"
assert dpopt.__version__ == md.version("dpopt") != "0+unknown", dpopt.__version__
torch = next(Requirement(r) for r in md.requires("dpopt") if Requirement(r).name == "torch")
assert torch.specifier.contains("2.11.0") and torch.specifier.contains("2.99.0"), f"torch requirement: {torch}"
print(f"  dpopt {dpopt.__version__} from the venv; requires {torch}")
EOF
WANT=$("$PY" -c "import tomllib; print(tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['version'])")
[ "$("$V/python" -c 'import dpopt; print(dpopt.__version__)')" = "$WANT" ] || fail "dpopt.__version__ is not pyproject's $WANT"
"$V/pip" check >/dev/null || { "$V/pip" check; fail "pip check"; }

step "dpopt --help"
"$V/dpopt" --help >"$WORK/help.txt" || fail "dpopt --help"
grep -q 'train' "$WORK/help.txt" || fail "dpopt --help lists no train"

step "a short private run (digits, one epoch)"
"$V/dpopt" train --epochs 1 --no-progress --secret-seed 0 --out "$WORK/run" >"$WORK/train.log" 2>&1 \
  || { cat "$WORK/train.log"; fail "dpopt train"; }
tail -n 1 "$WORK/train.log" | sed 's/^/  /'
"$V/python" -c "import json, math, sys; m = json.load(open(sys.argv[1])); assert 0 < m['epsilon'] <= 2.0 + 1e-9 and m['steps'] > 0, m" \
  "$WORK/run/metrics.json" || fail "metrics.json"

step "dpopt reproduce outside a checkout: one line, exit 2"
set +e
"$V/dpopt" reproduce >"$WORK/reproduce.out" 2>"$WORK/reproduce.err"
rc=$?
set -e
[ "$rc" = 2 ] && [ "$(wc -l <"$WORK/reproduce.err")" = 1 ] && grep -q checkout "$WORK/reproduce.err" \
  || { cat "$WORK/reproduce.out" "$WORK/reproduce.err"; fail "dpopt reproduce (exit $rc)"; }
sed 's/^/  /' "$WORK/reproduce.err"

step "passed in ${SECONDS} s"
