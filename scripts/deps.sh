#!/usr/bin/env bash
# Installs the system packages the build and the tests need, when they are missing.
# Debian/Ubuntu; run as root (or with sudo available). Prints what it does.
set -euo pipefail
# mpich + libmpich-dev: the MPICH-ABI shim (scripts/build-mpich.sh) and its tests; they install
# beside Open MPI, which stays the default mpicc/mpirun.
pkgs=(libucx-dev openmpi-bin libopenmpi-dev mpich libmpich-dev libclang-dev pkg-config build-essential)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
echo "deps: installing ${missing[*]}"
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null; then sudo=sudo; else
    echo "deps: missing packages ${missing[*]} and not root: install them first" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
