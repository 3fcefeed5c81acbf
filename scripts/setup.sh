#!/usr/bin/env bash
# Create the project environments (idempotent), each from its hashed lock file (envs/*.lock, made
# by `make lock` = scripts/lock.sh): `.venv` (the core: CPU torch, transformers, DVC, plus a portable
# llama-cpp-python built from its sdist, and that sdist's converter, gguf-py, llama-imatrix and
# llama-perplexity) and `.envs/<name>`
# for every tool that pins its own torch/transformers. uv (pinned, envs/uv.lock) installs them
# concurrently while llama-cpp-python compiles.
#
# Environment knobs:
#   PYTHON              interpreter to create the venvs with (default: python3)
#   PIPELINE_CACHE      where uv, the sdist and the built wheel are kept (default: ~/.cache/pipeline)
#   PIPELINE_FIND_LINKS where torch's CPU wheel is (default: /opt/wheels; see scripts/lock.sh)
set -euo pipefail

cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON_VERSION=0.3.36
LLAMA_CPP_PYTHON_SDIST_SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
CACHE="${PIPELINE_CACHE:-$HOME/.cache/pipeline}"
FIND_LINKS="${PIPELINE_FIND_LINKS:-/opt/wheels}"
VENV=.venv
PY="$VENV/bin/python"
# Portable CPU build: the default -march=native build segfaults on AMX CPUs on the first decode of
# a quantized GGUF. AVX2 stays on; AVX-512 and AMX are off.
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
BUILD_TAG=$(printf '%s' "$CMAKE_FLAGS" | sha256sum | cut -c1-12)

log() { printf '[setup] %s\n' "$*" >&2; }

# Install exactly LOCK... into the venv DIR unless its stamp says it already holds them. The stamp
# (`DIR/.pipeline-lock`: each lock file and its sha256) is what the step workers report as their
# toolchain's `lock`, so a changed lock makes every target built in that environment stale.
# The whole site-packages is compiled to bytecode at install: every step is a new process, and where
# PYTHONDONTWRITEBYTECODE is set (as on this project's hosts) Python would otherwise compile each
# module from source on every import (measured: `import vllm...api_server` 15.2 s -> 6.8 s, a
# vLLM CPU engine's start 48 s -> 23 s, `import llmcompressor` 12.1 s -> 5.1 s). A venv installed
# before this (no `DIR/.pipeline-bytecode`) is synced again, which only compiles; the stamp stays
# as it was (it is part of every artifact's inputs).
sync_env() {  # DIR LOCK...
  local dir=$1; shift
  local stamp="" lock
  for lock in "$@"; do stamp+="$lock sha256:$(sha256sum "$lock" | cut -d' ' -f1) "; done
  stamp=${stamp% }
  if [ "$(cat "$dir/.pipeline-lock" 2>/dev/null)" = "$stamp" ] && [ -f "$dir/.pipeline-bytecode" ]; then
    return
  fi
  log "installing $* into $dir"
  [ -x "$dir/bin/python" ] || "${PYTHON:-python3}" -m venv "$dir"
  rm -f "$dir/.pipeline-lock"
  scripts/uv.sh pip sync -q --compile-bytecode --python "$dir/bin/python" --require-hashes \
    --find-links "$FIND_LINKS" "$@"
  echo "$stamp" > "$dir/.pipeline-lock"
  touch "$dir/.pipeline-bytecode"
}

scripts/uv.sh --version >/dev/null  # installed once, before the environments race for it

# 1. Every environment from its lock, concurrently, in the background (uv is network- and
#    disk-bound; the llama-cpp-python build below is CPU-bound). Output: .envs/<name>.setup.log.
mkdir -p .envs
declare -A JOBS=()
sync_env "$VENV" envs/core.lock envs/testdata.lock >".envs/core.setup.log" 2>&1 &
JOBS[core]=$!
# the tool environments: pipeline/environments.py's table (stdlib only: readable before any venv)
TOOL_ENVS=$("${PYTHON:-python3}" -m pipeline.environments locked | cut -d' ' -f1)
for name in $TOOL_ENVS; do
  sync_env ".envs/$name" "envs/$name.lock" >".envs/$name.setup.log" 2>&1 &
  JOBS[$name]=$!
done

# 2. llama-cpp-python: sdist downloaded once (sha256 checked), wheel built once per (version, flags).
SDIST_DIR="$CACHE/sdist"
SDIST="$SDIST_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  log "downloading llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
  "${PYTHON:-python3}" -m pip --disable-pip-version-check -q download --no-binary :all: --no-deps \
    -d "$SDIST_DIR" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
if [ "$(sha256sum "$SDIST" | cut -d' ' -f1)" != "$LLAMA_CPP_PYTHON_SDIST_SHA256" ]; then
  log "$SDIST: sha256 is not $LLAMA_CPP_PYTHON_SDIST_SHA256 (corrupted download?); delete it and rerun"
  exit 1
fi
WHEEL_DIR="$CACHE/wheels/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-$BUILD_TAG"
WHEEL=$(ls "$WHEEL_DIR"/llama_cpp_python-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$WHEEL" ]; then
  log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION portable wheel (about 10 minutes on 2 cores)"
  rm -rf "$WHEEL_DIR.tmp" && mkdir -p "$WHEEL_DIR.tmp"
  CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "${PYTHON:-python3}" -m pip --disable-pip-version-check -q wheel --no-deps --no-cache-dir \
    -w "$WHEEL_DIR.tmp" "$SDIST"
  mv -T "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  WHEEL=$(ls "$WHEEL_DIR"/llama_cpp_python-*.whl | head -n1)
fi

# 2b. llama.cpp's own tools from the same sdist and flags (static, so they need no library path):
#     llama-imatrix (importance matrix), llama-perplexity (PPL, KL divergence to an F16 base) and
#     llama-server (a GGUF's deploy command; without its web UI, which its build would download),
#     llama-batched-bench (the engine's batched decode alone: benchmarks/llama_decode_overhead.py).
#     Built once per (version, flags, tool list) into the cache; about 10 minutes on 2 cores.
TOP="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
TOOLS=(llama-imatrix llama-perplexity llama-server llama-batched-bench)
TOOLS_DIR="$CACHE/tools/llama.cpp-$LLAMA_CPP_PYTHON_VERSION-$BUILD_TAG"
if [ "$(cat "$TOOLS_DIR/.complete" 2>/dev/null)" != "${TOOLS[*]}" ]; then
  log "building ${TOOLS[*]} from the sdist's llama.cpp"
  SRC="$CACHE/tools/src.tmp"
  rm -rf "$SRC" "$TOOLS_DIR" && mkdir -p "$SRC"
  tar -xzf "$SDIST" -C "$SRC" --strip-components=3 "$TOP/vendor/llama.cpp"
  # shellcheck disable=SC2086  # CMAKE_FLAGS is a list of flags
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF $CMAKE_FLAGS \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF >"$CACHE/tools/cmake.log" 2>&1 \
    || { log "cmake configure failed: see $CACHE/tools/cmake.log"; exit 1; }
  cmake --build "$SRC/build" --target "${TOOLS[@]}" -j "$(nproc)" >>"$CACHE/tools/cmake.log" 2>&1 \
    || { log "building ${TOOLS[*]} failed: see $CACHE/tools/cmake.log"; exit 1; }
  mkdir -p "$TOOLS_DIR"
  for tool in "${TOOLS[@]}"; do cp "$SRC/build/bin/$tool" "$TOOLS_DIR/"; done
  echo "${TOOLS[*]}" >"$TOOLS_DIR/.complete"
  rm -rf "$SRC"
fi

failed=()
for name in "${!JOBS[@]}"; do
  wait "${JOBS[$name]}" || failed+=("$name (see .envs/$name.setup.log)")
done
[ ${#failed[@]} -eq 0 ] || { log "installing environments failed: ${failed[*]}"; exit 1; }

# 3. The converter, gguf-py and the llama.cpp commit from the same sdist, placed inside the venv.
SHARE="$VENV/share/pipeline/llama.cpp"
if [ ! -f "$SHARE/BUILD.json" ] || ! grep -q "\"$LLAMA_CPP_PYTHON_VERSION\"" "$SHARE/BUILD.json"; then
  log "extracting convert_hf_to_gguf.py and gguf-py from the sdist"
  rm -rf "$SHARE" && mkdir -p "$SHARE"
  top=$TOP
  tar -xzf "$SDIST" -C "$SHARE" --strip-components=3 \
    "$top/vendor/llama.cpp/convert_hf_to_gguf.py" "$top/vendor/llama.cpp/conversion" \
    "$top/vendor/llama.cpp/gguf-py" "$top/vendor/llama.cpp/LICENSE"
  # The sdist has no git metadata; its CHANGELOG names the llama.cpp commit of each release.
  commit=$(tar -xzOf "$SDIST" "$top/CHANGELOG.md" \
    | awk -v v="## [$LLAMA_CPP_PYTHON_VERSION]" '$0==v{f=1;next} /^## \[/{f=0} f' \
    | grep -o 'ggml-org/llama.cpp@[0-9a-f]*' | head -n1 | cut -d@ -f2)
  "$PY" - "$SHARE/BUILD.json" "$LLAMA_CPP_PYTHON_VERSION" "${commit:-unknown}" "$LLAMA_CPP_PYTHON_SDIST_SHA256" "$CMAKE_FLAGS" <<'PYEOF'
import json, sys
path, version, commit, sha, flags = sys.argv[1:]
json.dump({"llama_cpp_python": version, "llama_cpp_commit": commit, "sdist_sha256": sha,
           "cmake_args": flags}, open(path, "w"), indent=2)
PYEOF
fi

mkdir -p "$SHARE/bin" && cp "$TOOLS_DIR/"llama-* "$SHARE/bin/"

# 4. What a lock cannot hold, into .venv by path without dependencies (theirs are in envs/core.txt):
#    the wheel built above, the sdist's gguf-py and the project itself (editable). A re-sync of a
#    changed lock removes them, so they are installed every time (seconds).
log "installing llama-cpp-python wheel, gguf-py and the project into $VENV"
scripts/uv.sh pip install -q --python "$PY" --no-deps "$WHEEL" "$SHARE/gguf-py" -e .

"$PY" - <<'PYEOF'
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
bad = [flag for flag in ("AMX_INT8 = 1", "AVX512 = 1") if flag in info]
if bad:
    raise SystemExit(f"[setup] llama-cpp-python is not a portable build ({', '.join(bad)}): {info}")
print(f"[setup] llama-cpp-python {llama_cpp.__version__}: {info.strip()}")
PYEOF
