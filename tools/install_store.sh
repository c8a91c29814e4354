#!/usr/bin/env bash
# Installs Mooncake Store's client and master into a venv made by bootstrap.sh, for the second
# tier and its tests (issue 38).
#
#   install_store.sh VENV
#
# The CPU build on PyPI, mooncake-transfer-engine-non-cuda (the plain mooncake-transfer-engine
# wheel links libcuda.so.1), ships the Python client (mooncake.store) and mooncake_master. Its
# transfer engine links libibverbs.so.1, librdmacm.so.1 and libnuma.so.1 even over TCP: where
# one is missing they are installed from the distribution (Debian/Ubuntu package names) when
# this runs as root, else this says which packages to install and exits 2.
set -euo pipefail
venv=${1:?usage: install_store.sh VENV}
py=$venv/bin/python
spec=${KVTRITON_STORE_SPEC:-mooncake-transfer-engine-non-cuda==0.3.13.post1}
if [[ ! -x "$py" ]]; then
  echo "install_store: no $py; make the venv first (tools/bootstrap.sh)" >&2
  exit 2
fi

missing=()
for pair in libibverbs.so.1:libibverbs1 librdmacm.so.1:librdmacm1 libnuma.so.1:libnuma1; do
  ldconfig -p | grep -qE "^[[:space:]]*${pair%%:*} " || missing+=("${pair##*:}")
done
if (( ${#missing[@]} )); then
  if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null; then
    echo "install_store: installing ${missing[*]} (apt-get)"
    apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${missing[@]}"; }
  else
    echo "install_store: Mooncake Store needs the system packages ${missing[*]}:" \
         "apt-get install ${missing[*]} (as root), then run this again" >&2
    exit 2
  fi
fi

if ! "$py" -c 'import mooncake.store, xxhash' >/dev/null 2>&1; then
  "$py" -m pip install -q --disable-pip-version-check "$spec" "xxhash>=3"
fi
"$py" -c 'import mooncake.store' || {
  echo "install_store: $spec is installed but mooncake.store does not import (above: why)" >&2
  exit 2
}
[[ -x $venv/bin/mooncake_master ]] || {
  echo "install_store: $spec installed no $venv/bin/mooncake_master" >&2
  exit 2
}
echo "install_store: $venv has $("$py" -m pip show mooncake-transfer-engine-non-cuda 2>/dev/null | sed -n 's/^Version: /mooncake-transfer-engine-non-cuda /p')"
