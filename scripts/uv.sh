#!/usr/bin/env bash
# Run the pinned uv (envs/uv.lock), installing it first with pip --require-hashes into
# $PIPELINE_CACHE/uv-<version> (shared by every clone on the host, outside the environments).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${PIPELINE_CACHE:-$HOME/.cache/pipeline}"
version=$(sed -n 's/^uv==\([^ ]*\).*/\1/p' envs/uv.lock)
home="$CACHE/uv-$version"
if [ ! -x "$home/bin/uv" ]; then
  printf '[setup] installing uv %s into %s\n' "$version" "$home" >&2
  rm -rf "$home.tmp-$$"
  "${PYTHON:-python3}" -m venv "$home.tmp-$$"
  "$home.tmp-$$/bin/python" -m pip --disable-pip-version-check -q install --require-hashes --no-deps \
    -r envs/uv.lock
  mv -T "$home.tmp-$$" "$home" 2>/dev/null || rm -rf "$home.tmp-$$"  # another clone won the race
fi
exec "$home/bin/uv" "$@"
