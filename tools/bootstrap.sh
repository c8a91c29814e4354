#!/usr/bin/env bash
# Creates the project's virtual environment: torch, triton, the project and its dev/plot extras.
# A CUDA torch already importable by the base Python is reused (never replaced); otherwise the
# CPU build torch==2.13.0 is installed.
set -euo pipefail
py=${1:-python3}
venv=${2:-.venv}

if ! command -v "$py" >/dev/null 2>&1; then
  echo "bootstrap: no interpreter '$py'; set PYTHON=... to a Python >= 3.10" >&2
  exit 2
fi
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
  echo "bootstrap: $("$py" --version 2>&1) is too old; kvtriton needs Python >= 3.10" >&2
  exit 2
fi

if "$py" -c 'import sys, torch; sys.exit(0 if torch.version.cuda else 1)' 2>/dev/null; then
  echo "bootstrap: reusing the CUDA torch of $py"
  "$py" -m venv --system-site-packages "$venv"
else
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev,plot]"
"$venv/bin/python" -c 'import torch, triton, kvtriton; print(f"bootstrap: torch {torch.__version__}, triton {triton.__version__}, kvtriton {kvtriton.__version__}, cuda={torch.cuda.is_available()}")'
