#!/usr/bin/env bash
# Creates the project's virtual environment: torch, triton, the project and its dev/plot extras.
#
#   bootstrap.sh [--plan] [python] [venv]      --plan: say what would be done, change nothing
#
# A GPU torch (CUDA or ROCm) that `python` imports is reused, never replaced, wherever it is
# installed: for a base interpreter the venv is made with --system-site-packages; for a venv's
# interpreter (uv-style GPU images), whose --system-site-packages would show the base's packages
# and not that venv's, the new venv gets a .pth file adding the directories that interpreter
# imports torch and its packages from. KVTRITON_REUSE_TORCH=1 reuses a CPU torch the same way.
# Otherwise torch==2.13.0 is installed: from PyPI on Linux x86-64 that is the CUDA build (with its
# nvidia-* wheels, several GB); the CPU build where pip's index or wheel cache serves one, or with
# KVTRITON_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Offline (PIP_NO_INDEX or KVTRITON_OFFLINE=1 set, or the index does not answer) the project is
# installed without build isolation, from what is already installed or in pip's cache.
set -euo pipefail
plan=0
if [[ "${1:-}" == "--plan" ]]; then
  plan=1
  shift
fi
py=${1:-python3}
venv=${2:-.venv}
torch_pin=torch==2.13.0
torch_floor=2.8  # pyproject.toml: the first torch paired with Triton >= 3.4 (`triton.knobs`)
pip_q=(-q --disable-pip-version-check)

if ! command -v "$py" >/dev/null 2>&1; then
  echo "bootstrap: no interpreter '$py'; set PYTHON=... to a Python >= 3.10" >&2
  exit 2
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "bootstrap: $("$py" --version 2>&1) is too old; kvtriton needs Python >= 3.10" >&2
  exit 2
fi

if [[ "$("$py" -c 'import sys; print(sys.prefix)')" -ef "$venv" ]]; then
  echo "bootstrap: '$py' belongs to $venv itself; give the interpreter it should be made from" >&2
  exit 2
fi

# What `py` imports: torch's version, GPU runtime and location, and whether `py` is a venv's.
probe=$("$py" - "$torch_floor" <<'EOF' 2>/dev/null || true
import os, sys, sysconfig
try:
    import torch
except Exception:
    raise SystemExit(0)
floor = tuple(int(x) for x in sys.argv[1].split("."))
have = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
print("version=" + torch.__version__)
print("gpu=" + (torch.version.cuda or getattr(torch.version, "hip", None) or ""))
print("old=" + ("1" if have < floor else ""))
print("venv=" + ("1" if sys.prefix != sys.base_prefix else ""))
dirs = [os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__)))]
dirs += [sysconfig.get_paths()[k] for k in ("purelib", "platlib")]
for d in dict.fromkeys(os.path.realpath(d) for d in dirs):
    print("dir=" + d)
EOF
)
version="" gpu="" old="" is_venv="" dirs=()
while IFS='=' read -r key value; do
  case "$key" in
    version) version=$value ;;
    gpu) gpu=$value ;;
    old) old=$value ;;
    venv) is_venv=$value ;;
    dir) dirs+=("$value") ;;
  esac
done <<<"$probe"

mode=install
if [[ -n "$version" && ( -n "$gpu" || "${KVTRITON_REUSE_TORCH:-}" == 1 ) ]]; then
  if [[ -n "$old" ]]; then
    echo "bootstrap: $py has torch $version, older than kvtriton's floor $torch_floor; not" \
         "replacing it: use an interpreter with torch >= $torch_floor" >&2
    exit 2
  fi
  mode=$([[ -n "$is_venv" ]] && echo pth || echo system-site)
fi

offline=""
if [[ -n "${PIP_NO_INDEX:-}" || "${KVTRITON_OFFLINE:-}" == 1 ]]; then
  offline=1
fi

if [[ $plan == 1 ]]; then
  echo "bootstrap plan: interpreter $py ($("$py" --version 2>&1)), venv $venv"
  case $mode in
    system-site) echo "  torch: reuse torch $version (GPU runtime ${gpu:-none}) of the base" \
                      "interpreter: python -m venv --system-site-packages" ;;
    pth) echo "  torch: reuse torch $version (GPU runtime ${gpu:-none}) of a venv's interpreter:" \
              "python -m venv, plus a .pth adding ${dirs[*]}" ;;
    install) echo "  torch: ${version:+torch $version is CPU-only, }install" \
                  "$torch_pin${KVTRITON_TORCH_INDEX_URL:+ from $KVTRITON_TORCH_INDEX_URL}" ;;
  esac
  echo "  project: pip install -e .[dev,plot]${offline:+ --no-build-isolation (offline)}"
  exit 0
fi

case $mode in
  system-site)
    echo "bootstrap: reusing torch $version (GPU runtime $gpu) of $py"
    "$py" -m venv --system-site-packages "$venv"
    ;;
  pth)
    echo "bootstrap: reusing torch $version (GPU runtime ${gpu:-none}) of the venv of $py"
    "$py" -m venv "$venv"
    site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # addsitedir, not a bare path: the other venv's own .pth files (editable installs,
    # namespace packages) are processed too; its directories come after this venv's own.
    for d in "${dirs[@]}"; do
      printf 'import site; site.addsitedir(%s)\n' "$("$py" -c 'import sys; print(repr(sys.argv[1]))' "$d")"
    done >"$site/_kvtriton_reuse_torch.pth"
    ;;
  install)
    "$py" -m venv "$venv"
    index=()
    if [[ -n "${KVTRITON_TORCH_INDEX_URL:-}" ]]; then
      index=(--index-url "$KVTRITON_TORCH_INDEX_URL")
    fi
    "$venv/bin/python" -m pip install "${pip_q[@]}" "${index[@]}" "$torch_pin"
    ;;
esac
if [[ $mode != install ]]; then
  "$venv/bin/python" -c "import sys, torch; sys.exit(torch.__version__ != '$version')" || {
    echo "bootstrap: $venv does not import the torch $version of $py" >&2
    exit 2
  }
fi

if [[ -z "$offline" ]] && ! timeout 20 "$venv/bin/python" -m pip index versions pip \
    "${pip_q[@]}" --timeout 5 --retries 0 >/dev/null 2>&1; then
  offline=1
fi
isolation=()
if [[ -n "$offline" ]]; then
  # Build isolation would fetch setuptools from the index: build with an installed one, which
  # must be >= 68 and build wheels (bdist_wheel is in setuptools >= 70.1, before in `wheel`).
  echo "bootstrap: no package index reachable; installing without build isolation"
  backend_ok() {
    "$venv/bin/python" -c 'import setuptools as s, sys; v = int(s.__version__.split(".")[0])
if v < 70: import wheel
sys.exit(v < 68)' 2>/dev/null
  }
  if ! backend_ok; then
    "$venv/bin/python" -m pip install "${pip_q[@]}" "setuptools>=70.1" 2>/dev/null || true
  fi
  if ! backend_ok && [[ $mode == pth ]]; then
    # The venv's bundled setuptools (Python 3.11: 65.x) hides a usable one the .pth reaches.
    "$venv/bin/python" -m pip uninstall "${pip_q[@]}" -y setuptools >/dev/null
  fi
  if ! backend_ok; then
    echo "bootstrap: offline and no setuptools >= 68 able to build wheels in $venv; install" \
         "one (or put its wheel in pip's find-links) and rerun" >&2
    exit 2
  fi
  isolation=(--no-build-isolation)
fi
"$venv/bin/python" -m pip install "${pip_q[@]}" "${isolation[@]}" -e ".[dev,plot]"
"$venv/bin/python" -c 'import torch, triton, kvtriton; print(f"bootstrap: torch {torch.__version__}, triton {triton.__version__}, kvtriton {kvtriton.__version__}, cuda={torch.cuda.is_available()}")'
