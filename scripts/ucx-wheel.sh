#!/usr/bin/env bash
# Installs a UCX >= 1.15 (headers and libraries) from the PyPI wheel `libucx-cu12` into a cache
# directory and prints its prefix, for building ucx-sys with the exported-memory-handle API:
#
#   UCX_DIR=$(scripts/ucx-wheel.sh) cargo build --release -p alias-mkey
#
# Debian's libucx-dev (1.13) lacks ucp_memh_pack's export flag; the default build keeps using it.
# The wheel's libraries are found at run time through the rpath-free search cargo does for link
# directories inside target/ (cargo run / cargo test); anything else needs
# LD_LIBRARY_PATH=$prefix/lib (the wheel's ucx.pc names its CI build directory, so pkg-config
# cannot be pointed at it).
#
# Environment: UCX_WHEEL_DIR (default target/ucx-wheel), UCX_WHEEL_SPEC (default
# libucx-cu12==1.22.0, the version tested here), PIP (default: python3 -m pip).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${UCX_WHEEL_DIR:-$root/target/ucx-wheel}
spec=${UCX_WHEEL_SPEC:-libucx-cu12==1.22.0}
pip=${PIP:-python3 -m pip}
prefix=$dir/libucx
stamp=$dir/.installed
case "${1:-}" in
  -h|--help)
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
    exit 0 ;;
  "") ;;
  *) echo "ucx-wheel.sh: takes no arguments (see --help)" >&2; exit 2 ;;
esac
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$spec" ] || [ ! -f "$prefix/include/ucp/api/ucp.h" ]; then
  echo "ucx-wheel: installing $spec into $dir" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  if ! $pip install --quiet --no-deps --disable-pip-version-check --root-user-action=ignore --target "$dir" "$spec" >&2; then
    echo "ucx-wheel: pip could not install $spec (is PyPI reachable?)" >&2
    exit 1
  fi
  echo "$spec" >"$stamp"
fi
for f in include/ucp/api/ucp.h lib/libucp.so lib/libucs.so lib/libuct.so lib/libucm.so; do
  if [ ! -e "$prefix/$f" ]; then
    echo "ucx-wheel: $spec has no $f under $prefix: not a UCX install" >&2
    exit 1
  fi
done
if ! grep -q UCP_MEMH_PACK_FLAG_EXPORT "$prefix/include/ucp/api/ucp.h"; then
  echo "ucx-wheel: $spec's ucp.h has no UCP_MEMH_PACK_FLAG_EXPORT (UCX < 1.15)" >&2
  exit 1
fi
echo "$prefix"
