#!/usr/bin/env bash
# Download the GPU host's tool environments as wheels for Python 3.12 / x86-64 (the H200 image:
# torch 2.11 + CUDA 13, transformers 5.17; the image's own packages are not listed), one folder
# per environment, ready for `carry.sh pack DIR`. Run here, in the repository root, once
# scripts/setup.sh has downloaded the llama-cpp-python sdist (its first minute): the core set takes
# gguf-py and the converter from it, and the compiled wheel and tools once set-up has built them.
#
#   benchmarks/gpu/fetch.sh DIR [ENV ...]     ENV: core vllm llmcompressor gptqmodel modelopt sglang
#                                             guidellm
#                                             (default: all)
#
# Lists: benchmarks/gpu/wheels/<env>.txt (the sets that ran on the H200; vllm and sglang are the
# lean sets found there, without what their code paths there do not import). GPTQModel 7.6.0 and
# four of its dependencies exist on PyPI only as pure-Python sdists: they are built into
# py3-none-any wheels here (GPTQModel without CUDA extensions: its kernels are JIT-compiled on
# first use, and the pipeline's worker uses its torch kernels). pypcre's sdist holds a C extension
# for CPython 3.12: it travels as the sdist and `carry.sh install` builds it there.
# guidellm: GuideLLM for the serving benchmark (issue 26), without what the image already holds
# (torch, transformers, httpx, pandas, pyarrow, numpy, uvloop...).
set -euo pipefail
out=$1; shift
envs=("$@"); [ ${#envs[@]} -gt 0 ] || envs=(core vllm llmcompressor gptqmodel modelopt sglang guidellm)
GPTQMODEL_SDISTS=(gptqmodel==7.6.0 device-smi==0.5.7 tokenicer==0.0.14 logbar==0.4.15 defuser==0.0.28)
PCRE_SDIST=pypcre==0.6.4
here=$(cd "$(dirname "$0")" && pwd)
PLATFORMS=()
for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
         manylinux_2_5_x86_64 manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done

for env in "${envs[@]}"; do
  dir=$out/$env
  mkdir -p "$dir"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$dir" -r "$here/wheels/$env.txt"
  case $env in
    core)  # this checkout's llama.cpp: gguf-py and the converter (the GPU tests need gguf-py to
      # read SmolLM2's tokenizer) and, once set-up has compiled it, the portable runtime wheel
      # (GGUF targets on the GPU host); before that, gguf-py and the converter come from the sdist
      # set-up downloads first, so the device work need not wait for the 10-minute compile
      share=.venv/share/pipeline/llama.cpp
      cache=${PIPELINE_CACHE:-$HOME/.cache/pipeline}
      if [ ! -f "$share/BUILD.json" ]; then
        sdist=$(ls "$cache"/sdist/llama_cpp_python-*.tar.gz | head -n1)  # scripts/setup.sh's first minute
        top=$(basename "$sdist" .tar.gz) && share=$(mktemp -d)
        tar -xzf "$sdist" -C "$share" --strip-components=3 "$top/vendor/llama.cpp/convert_hf_to_gguf.py" \
          "$top/vendor/llama.cpp/conversion" "$top/vendor/llama.cpp/gguf-py" "$top/vendor/llama.cpp/LICENSE"
        echo "core: gguf-py and the converter from $sdist (set-up not done: GGUF targets need a fetch after it)"
      fi
      wheel=$(ls "$cache"/wheels/llama-cpp-python-*/llama_cpp_python-*.whl 2>/dev/null | head -n1 || true)
      [ -z "$wheel" ] || cp "$wheel" "$dir/"
      python3 -m pip wheel -q --no-deps -w "$dir" "$share/gguf-py"
      rm -rf "$dir/llama.cpp" && cp -r "$share" "$dir/llama.cpp" && rm -rf "$dir/llama.cpp/gguf-py"
      [ "$share" = .venv/share/pipeline/llama.cpp ] || rm -rf "$share"
      ;;
    gptqmodel)  # pure-Python sdists -> wheels; pypcre's sdist as it is (built there)
      BUILD_CUDA_EXT=0 python3 -m pip wheel -q --no-deps -w "$dir" "${GPTQMODEL_SDISTS[@]}"
      python3 - "$dir" "$PCRE_SDIST" <<'PY'
import re, sys, urllib.request
out, spec = sys.argv[1], sys.argv[2]
name, version = spec.split("==")
page = urllib.request.urlopen(f"https://pypi.org/simple/{name}/").read().decode()
for href, file in re.findall(r'href="([^"]+)"[^>]*>([^<]+)<', page):
    if file == f"{name}-{version}.tar.gz":
        url, _, digest = href.partition("#sha256=")
        data = urllib.request.urlopen(url).read()
        import hashlib
        assert not digest or hashlib.sha256(data).hexdigest() == digest, f"{file}: sha256 mismatch"
        open(f"{out}/{file}", "wb").write(data)
        break
else:
    raise SystemExit(f"{spec}: no sdist on the index")
PY
      ;;
    sglang)  # FlashAttention 3 (1.1 GB unpacked) and the sm100 build left out: attention_backend triton
      for w in "$dir"/sglang_kernel-*.whl; do zip -q -d "$w" 'sgl_kernel/flash_ops.abi3.so' 'sgl_kernel/sm100/*' || true; done
      ;;
  esac
  echo "$env: $(ls "$dir" | wc -l) files, $(du -sh "$dir" | cut -f1)"
done
