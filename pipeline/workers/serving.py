"""The serve check, inside an engine's environment (stdlib only): start the deploy command (an
argument list the core built for a free loopback port), wait until it is ready, send the first
smoke prompt's token ids (greedy), compare the answer with the offline greedy answer, shut the
server down. Each engine's worker supplies how to ask its server (vLLM: OpenAI completions;
SGLang: its native /generate; llama-server: its native /completion)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.workers.protocol import dying_with_parent, exit_reason

# The tolerance: the served answer may leave the offline greedy answer only where the offline
# engine itself rated the two tokens within this many nats (a near-tie: the deploy command's CUDA
# graphs and fused kernels may round it the other way). Prompted by a 7B random-weight FP8
# checkpoint whose compiled vLLM server and eager offline engine chose different first tokens; that
# divergence turned out not to be a near-tie (the served token was outside the offline top-5).
NEAR_TIE_NATS = 0.1
TIE_TOP = 5  # top logprobs kept per generated token of the first smoke prompt

# (base url, request) -> {"text": str, "token_ids": list[int] | None}; None: the server answers text only
Ask = Callable[[str, dict[str, Any]], dict[str, Any]]


def run_argv(argv: list[str], artifact_dir: str, python: str = sys.executable) -> list[str]:
    """A deploy command's argument list as a deploy job runs it: this artifact's directory for
    ${ARTIFACT_DIR} (inside an argument: a path with spaces stays one), and the interpreter
    (default: this environment's) for the program `python`."""
    out = [a.replace("${ARTIFACT_DIR}", artifact_dir) for a in argv]
    return [python, *out[1:]] if out[:1] == ["python"] else out


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def serve_check(req: dict[str, Any], engine: str, ask: Ask) -> dict[str, Any]:
    """Run the serve check of `req` (argv, port, model_dir, prompt_ids, max_tokens, expected_ids,
    expected_text, expected_top, ready_timeout_s, server_log) against `engine`'s server."""
    port = req["port"]
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} on 127.0.0.1 is already in use")
    cmd = run_argv(req["argv"], req["model_dir"])
    t0 = time.perf_counter()
    # the server's own log, beside the step's (it outlives a step killed at its time limit)
    if req.get("server_log"):
        server_log = Path(req["server_log"])
        server_log.parent.mkdir(parents=True, exist_ok=True)
    else:
        fd, name = tempfile.mkstemp(prefix=f"{engine}-server-", suffix=".log")
        os.close(fd)
        server_log = Path(name)
    print(f"serve check: {' '.join(cmd)} (server log: {server_log})", flush=True)
    with open(server_log, "w") as out:
        server = subprocess.Popen(dying_with_parent(cmd), stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        while True:
            if (why := exit_reason(server, server_log)) is not None:
                code = server.returncode
                raise RuntimeError(f"{engine} server exited with code {code} before it was ready: {why}")
            if time.perf_counter() - t0 > req["ready_timeout_s"]:
                raise RuntimeError(f"{engine} server not ready after {req['ready_timeout_s']}s")
            try:  # every engine answers 503 (or refuses) until the model is loaded and warmed up
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                time.sleep(1)
        ready_s = time.perf_counter() - t0
        t1 = time.perf_counter()
        answer = ask(base, req)
        ids = answer["token_ids"]
        compared = "token_ids" if ids is not None else "text"
        ok = ids == req["expected_ids"] if ids is not None else answer["text"] == req["expected_text"]
        divergence = None
        if ids is not None and not ok:
            divergence = first_divergence(ids, req["expected_ids"], req.get("expected_top") or [])
            ok = divergence["near_tie"]
        return {
            "ok": ok,
            "compared": compared,
            "divergence": divergence,
            "text": answer["text"],
            "token_ids": ids,
            "expected_text": req["expected_text"],
            "expected_ids": req["expected_ids"],
            "finish_reason": answer.get("finish_reason"),
            "ready_s": ready_s,
            "request_s": time.perf_counter() - t1,
            # the program by its name (`python`, `llama-server`), not this host's path to it
            "command": " ".join([os.path.basename(req["argv"][0]), *cmd[1:]]),
        }
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def first_divergence(
    served: list[int], expected: list[int], expected_top: list[dict[str, float]]
) -> dict[str, Any]:
    """Where the served token ids first leave the offline greedy ones, and whether that is a
    near-tie: the served token among the offline engine's top logprobs at that step, at most
    NEAR_TIE_NATS below the token the offline engine chose."""
    i = next((k for k, (a, b) in enumerate(zip(served, expected, strict=False)) if a != b), None)
    if i is None:
        i = min(len(served), len(expected))  # one stopped early (or both equal: not called then)
    got = served[i] if i < len(served) else None
    want = expected[i] if i < len(expected) else None
    top = expected_top[i] if i < len(expected_top) else {}
    gap = None
    if got is not None and want is not None and str(got) in top and str(want) in top:
        gap = top[str(want)] - top[str(got)]
    return {
        "position": i,
        "served": got,
        "expected": want,
        "gap_nats": gap,
        "near_tie": gap is not None and gap <= NEAR_TIE_NATS,
    }
