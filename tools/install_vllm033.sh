#!/usr/bin/env bash
# Unpacks vLLM 0.33.0 beside the venv's vLLM 0.32, for the scheduler-role tests' second lane.
#
#   install_vllm033.sh VENV      (the tree: $KVTRITON_VLLM033_PATH, default VENV/vllm033)
#
# 0.33.0 has no CPU build on PyPI. Its CUDA wheel is downloaded without dependencies and its
# Python files are unpacked into the tree; first on PYTHONPATH, the tree imports over the venv's
# 0.32 dependencies, enough for vLLM's Scheduler and kv_offload (no engine: the kernels are CUDA
# ones). The compiled libraries, C/CUDA headers and the vllm-rs binary are left out (750 of the
# 810 MB unpacked). Nothing to do if the tree already holds 0.33.0. About 10 s (a 336 MB
# download), 63 MB on disk.
set -euo pipefail
version=0.33.0
venv=${1:?usage: install_vllm033.sh VENV}
py=$venv/bin/python
tree=${KVTRITON_VLLM033_PATH:-$venv/vllm033}
if [[ ! -x "$py" ]]; then
  echo "install_vllm033: no $py; make the venv first (tools/bootstrap.sh)" >&2
  exit 2
fi

# The version the tree's own metadata names (empty: none there).
tree_version() {
  "$py" - "$1" <<'EOF'
import importlib.metadata as md, sys
print(next((d.version for d in md.distributions(name="vllm", path=[sys.argv[1]])), ""))
EOF
}

if [[ "$(tree_version "$tree")" == "$version" ]]; then
  echo "install_vllm033: $tree already has vllm $version"
  exit 0
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vllm033.XXXXXX")
trap 'rm -rf "$work"' EXIT
if ! "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
     "vllm==$version" -d "$work/wheel" >"$work/pip.log" 2>&1; then
  why=$(grep -m1 '^ERROR' "$work/pip.log" || tail -n1 "$work/pip.log")
  echo "install_vllm033: pip download vllm==$version --no-deps failed: ${why%% (from versions*}" >&2
  exit 2
fi
wheel=$(ls "$work"/wheel/vllm-"$version"-*.whl)
"$py" - "$wheel" "$work/tree" <<'EOF'
import sys, zipfile
SKIP = (".so", ".h", ".hpp", ".cuh", ".inl", ".cu", ".cpp", ".c")
with zipfile.ZipFile(sys.argv[1]) as whl:
    whl.extractall(sys.argv[2], [m for m in whl.namelist()
                                 if not m.endswith(SKIP) and m != "vllm/vllm-rs"])
EOF
got=$(tree_version "$work/tree")
if [[ "$got" != "$version" || ! -f "$work/tree/vllm/v1/core/sched/scheduler.py" ]]; then
  echo "install_vllm033: $wheel unpacked as vllm '${got}', not $version with its scheduler" >&2
  exit 2
fi
rm -rf "$tree"
mkdir -p "$(dirname "$tree")"
mv "$work/tree" "$tree"
echo "install_vllm033: vllm $version in $tree (scheduler role only; tools/install_vllm033.sh)"
