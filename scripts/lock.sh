#!/usr/bin/env bash
# `make lock`: re-resolve every environment's lock file (envs/<name>.lock, hashes for every file)
# from its inputs (envs/<name>.txt; the core also pyproject.toml's extras). Run it after editing an
# input, review `git diff envs/`, commit; scripts/setup.sh then installs exactly those files.
# The locks are for x86_64 Linux CPU hosts with Python 3.11; torch's CPU build is found through
# PIPELINE_FIND_LINKS (default /opt/wheels, where these machines keep it; elsewhere
# https://download.pytorch.org/whl/cpu/torch/).
set -euo pipefail
cd "$(dirname "$0")/.."
FIND_LINKS="${PIPELINE_FIND_LINKS:-/opt/wheels}"
compile() {  # OUT INPUT... [-- uv options]
  local out=$1; shift
  scripts/uv.sh pip compile -q --generate-hashes --python-version 3.11 \
    --python-platform x86_64-manylinux_2_28 --find-links "$FIND_LINKS" \
    --custom-compile-command "make lock" -o "$out" "$@"
}
compile envs/uv.lock envs/uv.txt
compile envs/core.lock pyproject.toml envs/core.txt \
  --extra reference --extra llamacpp-server --extra dvc --extra report --extra cluster --extra datasets --extra dev
compile envs/testdata.lock envs/testdata.txt --no-deps
# every tool environment of pipeline/environments.py's table, with its own compile options
while read -r name options; do
  # shellcheck disable=SC2086  # options: zero or more words
  compile "envs/$name.lock" "envs/$name.txt" $options
done < <("${PYTHON:-python3}" -m pipeline.environments locked)
echo "[lock] envs/*.lock written; review with: git diff --stat envs/"
