"""The serve check on the core side, shared by the engines that serve over HTTP (vLLM, SGLang,
llama.cpp's llama-server): the engine's worker runs the manifest's serve command once
(pipeline.workers.serving), and a served answer that leaves the offline greedy answer fails that
engine's verdict.

Like is compared with like: the offline answer comes from an eager engine (no CUDA graphs, no
compilation; llama-cpp-python: no flash attention), so the server runs the deploy command in that
mode too, adding the engine's arguments for it (OfflineMode) where the command lacks them. CUDA
graphs and torch.compile may round a near-tie the other way,
and on random weights nearly every greedy step is a near-tie (a 7B random-weight FP8 checkpoint's
compiled server chose a token outside the eager engine's top-5). `serve_check.modes` records which
comparison was made; the deploy command in the manifest stays as the recipe wrote it."""

from __future__ import annotations

import shlex
import socket
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from pipeline.context import BuildContext
from pipeline.errors import EngineError
from pipeline.manifest import EngineVerdict
from pipeline.spec import ServeSpec

SERVE_TIMEOUT_S = 900
ARTIFACT_DIR = "${ARTIFACT_DIR}"  # where a deploy job puts the artifact, substituted or expanded
LOOPBACK = "127.0.0.1"
# A target's deploy command builder (Target.serve_argv): the recipe's serve section -> argv.
ServeArgv = Callable[[ServeSpec], list[str]]


@dataclass(frozen=True)
class OfflineMode:
    """How an engine scored offline, and the server arguments that make its deploy command run
    the same way for the serve check (vLLM: eager, `--enforce-eager`)."""

    name: str
    args: tuple[str, ...]


def free_port() -> int:
    """A loopback port nobody listens on now (the server started next takes it)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def local_argv(
    serve_argv: ServeArgv, serve: ServeSpec, port: int, locate: Callable[[str], str] = str
) -> list[str]:
    """The deploy command as the build runs it here: the recipe's knobs on a loopback `port`
    (built so, not patched into a recorded command), its program where `locate` (the engine
    environment's BuildContext.program) finds it on this host."""
    program, *args = serve_argv(serve.model_copy(update={"host": LOOPBACK, "port": port}))
    return [locate(program), *args]


def command_line(argv: list[str]) -> str:
    """A serve command as the manifest records it: every value shell-quoted (a value that needs no
    quotes is written as it is), `${ARTIFACT_DIR}` left for the deploy job to substitute or expand.
    `sh -c` of the result runs exactly `argv`."""
    words = []
    for arg in argv:
        if arg.startswith(ARTIFACT_DIR):
            rest = arg.removeprefix(ARTIFACT_DIR)
            words.append(ARTIFACT_DIR + (shlex.quote(rest) if rest else ""))
        else:
            words.append(shlex.quote(arg))
    return " ".join(words)


def serve_check(
    ctx: BuildContext,
    env: str,
    name: str,
    artifact: Path,
    serve_argv: ServeArgv,
    scores: dict[str, Any],
    result: EngineVerdict,
    offline: OfflineMode,
) -> None:
    """Run the deploy command (`serve_argv` of the recipe's serve section, on a free loopback port)
    for `artifact` in env's worker and record it in `result.details["serve_check"]`; `scores` is
    the same engine's offline result (its greedy answer and top logprobs), obtained in `offline`'s
    mode, whose arguments put the server in that mode too."""
    ref, _ = ctx.reference()
    expected = scores["generations"][0]
    serve, port = ctx.serve(name), free_port()
    deployed = serve_argv(serve)
    n = len(offline.args)
    as_deployed = any(deployed[i : i + n] == list(offline.args) for i in range(len(deployed)))
    same = [] if as_deployed else list(offline.args)
    checked = command_line(deployed + same)  # what the record says was served
    added = "as it is" if as_deployed else "+ " + " ".join(offline.args)
    modes = f"{offline.name} offline vs {offline.name} server (the deploy command {added})"
    try:
        served = ctx.step(
            env,
            {
                "op": "serve_check",
                "model_dir": str(artifact),
                "argv": local_argv(serve_argv, serve, port, partial(ctx.program, env)) + same,
                "port": port,
                "prompt_ids": ref["generations"][0]["prompt_ids"],
                "max_tokens": ctx.loaded.recipe.smoke.max_new_tokens,
                "expected_text": expected["text"],
                "expected_ids": expected["output_ids"],
                "expected_top": scores.get("first_generation_top_logprobs") or [],
                "server_log": str(ctx.log_path(f"{name}-{env}-server")),
                "ready_timeout_s": SERVE_TIMEOUT_S - 240,  # + the request and shutdown < the step limit
            },
            name,
            timeout_s=SERVE_TIMEOUT_S,
        )
    except EngineError as exc:  # the server never answered: the offline scores still stand
        result.details["serve_check"] = {"ok": False, "command": checked, "modes": modes, "error": str(exc)}
        _fail(result, f"the serve check's server did not answer: {exc}")
        return
    served["modes"] = modes
    result.details["serve_check"] = served
    if served["ok"]:
        return
    at = served.get("divergence") or {}
    gap = at.get("gap_nats")
    rated = f"{gap:.3f} nats below the offline choice" if gap is not None else "not a near-tie"
    where = f" from token {at['position']} ({rated})" if at else ""
    _fail(
        result,
        f"the served answer differs from the offline greedy answer ({served['compared']}){where}: "
        f"{served['text']!r} {served['token_ids']} vs {expected['text']!r} {expected['output_ids']}",
    )


def _fail(result: EngineVerdict, why: str) -> None:
    """The serve check fails the verdict; a reason it already failed for (a gate) stays first."""
    result.status = "failed"
    result.reason = f"{result.reason}; {why}" if result.reason else why
