"""What llama-server adds to llama.cpp's own batched decode (issue 26): at N parallel sequences,
llama-batched-bench's text-generation step time beside llama-server's per-token time for N
concurrent requests of the same lengths, on the same GGUF with the same context, micro-batch and
GPU layers. The ratio server / engine is what the server's slot loop costs (sampling over the
vocabulary, its batch, HTTP): on 2026-12-06 the H100's deploy command decoded 32 streams at
ITL p50 44 ms where one stream took 3.5 ms.

    python benchmarks/llama_decode_overhead.py MODEL.gguf --parallel 1,4,16 [--prompt-tokens 64]
        [--output-tokens 128] [--ngl N] [--threads T] [--server-arg=--kv-unified ...] [--json OUT]

Both sides start every sequence together: batched-bench prefills all prompts, then decodes one
token per sequence per step; the server gets N requests at once (token-id prompts of the given
length, `ignore_eos`, no prompt cache) and reports each slot's time per generated token, which at
N busy slots is the step's. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pipeline.engines.serving import free_port
from pipeline.spec import LLAMA_SLOT_STEP
from pipeline.workers.llamacpp import tool
from pipeline.workers.loadgen import wait_ready
from pipeline.workers.serving import post_json


class OverheadError(RuntimeError):
    """A side that could not be measured: one line naming why."""


def slot_tokens(prompt: int, output: int) -> int:
    """One sequence's KV cells, padded as llama.cpp pads a slot."""
    return -(-(prompt + output + 1) // LLAMA_SLOT_STEP) * LLAMA_SLOT_STEP


def engine_steps(
    gguf: Path, parallel: list[int], prompt: int, output: int, common: list[str]
) -> dict[int, Any]:
    """llama-batched-bench's text-generation phase per parallel count: ms per step, tokens/s."""
    ctx = max(parallel) * slot_tokens(prompt, output)
    argv = [str(tool("llama-batched-bench")), "-m", str(gguf), "-c", str(ctx), "-npp", str(prompt),
            "-ntg", str(output), "-npl", ",".join(map(str, parallel)), "--output-format", "jsonl",
            *common]  # fmt: skip
    run = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
    rows = [
        json.loads(line) for line in (run.stdout + run.stderr).splitlines() if line.startswith('{"n_kv_max"')
    ]
    if run.returncode or not rows:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise OverheadError(f"llama-batched-bench exited {run.returncode}: {tail[0]}")
    return {r["pl"]: {"step_ms": 1000 * r["t_tg"] / r["tg"], "tokens_per_s": r["speed_tg"]} for r in rows}


@contextmanager
def llama_server(gguf: Path, slots: int, slot: int, args: list[str], log: Path) -> Iterator[str]:
    """A ready llama-server on `gguf` with `slots` slots of `slot` KV cells each and `args` more:
    its base URL (OverheadError, one line, if it does not start); killed on leaving."""
    port = free_port()
    argv = [str(tool("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-c", str(slots * slot), "-np", str(slots), *args]  # fmt: skip
    with log.open("w") as out:
        server = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        try:  # the serving benchmark's own wait: the server's exit reason or a time limit, one line
            wait_ready(server, base, log, 300)
        except RuntimeError as exc:
            raise OverheadError(f"llama-server: {exc}") from None
        yield base
    finally:
        server.kill()
        server.wait()


def post_concurrently(url: str, bodies: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], float]:
    """Every body posted at once, one thread each: the answers and the wall seconds until the last
    (OverheadError naming the first failure and how many failed)."""
    got: list[dict[str, Any]] = []
    failed: list[str] = []

    def one(body: dict[str, Any]) -> None:
        try:
            got.append(post_json(url, body, 1800))
        except (urllib.error.URLError, OSError, ValueError) as exc:
            failed.append(str(exc))

    threads = [threading.Thread(target=one, args=(body,)) for body in bodies]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    if failed:
        raise OverheadError(f"{len(failed)} of {len(bodies)} requests to llama-server failed: {failed[0]}")
    return got, wall


def server_steps(
    gguf: Path, parallel: list[int], prompt: int, output: int, common: list[str], extra: list[str], log: Path
) -> dict[int, Any]:
    """llama-server with max(parallel) slots: per parallel count, the slots' median ms per generated
    token and the aggregate output tokens/s over the wall time of the N requests."""

    def body(i: int) -> dict[str, Any]:  # a distinct token-id prompt per request, no shared prefix
        ids = [100 + (i * 7919 + j * 104729) % 20000 for j in range(prompt)]
        return {"prompt": ids, "n_predict": output, "ignore_eos": True, "cache_prompt": False}

    slot = slot_tokens(prompt, output)
    with llama_server(gguf, max(parallel), slot, [*common, *extra], log) as base:
        completion = f"{base}/completion"
        post_json(completion, body(10**6), 600)  # warm-up: first-use allocations, CUDA graphs
        results: dict[int, Any] = {}
        for n in parallel:
            got, wall = post_concurrently(completion, [body(i) for i in range(n)])
            short = [r["tokens_predicted"] for r in got if r.get("tokens_predicted") != output]
            if short:
                raise OverheadError(f"llama-server generated {short[0]} tokens, not {output} (ignore_eos)")
            per_token = [r["timings"]["predicted_per_token_ms"] for r in got]
            results[n] = {"step_ms": statistics.median(per_token), "tokens_per_s": n * output / wall}
        return results


def measure(args: argparse.Namespace) -> dict[str, Any]:
    parallel = sorted({int(p) for p in args.parallel.split(",") if p})
    common = ["-ub", str(args.ubatch), "-ngl", str(args.ngl)] + (
        ["-t", str(args.threads)] if args.threads else []
    )
    log = (args.json or Path("/tmp/llama-decode-overhead.json")).with_suffix(".server.log")
    engine = engine_steps(args.gguf, parallel, args.prompt_tokens, args.output_tokens, common)
    server = server_steps(
        args.gguf, parallel, args.prompt_tokens, args.output_tokens, common, args.server_arg, log
    )
    levels = {
        str(n): {
            "engine_step_ms": engine[n]["step_ms"],
            "engine_tokens_per_s": engine[n]["tokens_per_s"],
            "server_step_ms": server[n]["step_ms"],
            "server_tokens_per_s": server[n]["tokens_per_s"],
            "server_over_engine": server[n]["step_ms"] / engine[n]["step_ms"],
        }
        for n in parallel
        if n in engine
    }
    return {"gguf": str(args.gguf), "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "common_args": common, "server_args": args.server_arg, "levels": levels}  # fmt: skip


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"{Path(result['gguf']).name}, {result['prompt_tokens']}/{result['output_tokens']} tokens, "
        f"{' '.join(result['common_args'])} {' '.join(result['server_args'])}".rstrip(),
        "",
        "| parallel | engine ms / step | server ms / token | server / engine | engine tok/s (decode) | "
        "server tok/s (wall, prefill included) |",
        "|---|---|---|---|---|---|",
    ]
    for n, lv in result["levels"].items():
        lines.append(
            f"| {n} | {lv['engine_step_ms']:.2f} | {lv['server_step_ms']:.2f} | "
            f"{lv['server_over_engine']:.2f} | {lv['engine_tokens_per_s']:.1f} | "
            f"{lv['server_tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--parallel", default="1,4,16")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--ubatch", type=int, default=512)
    parser.add_argument("--ngl", default="0", help="layers on the GPU (all: every one)")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--server-arg", action="append", default=[], help="one more llama-server argument")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.gguf.is_file():
        sys.exit(f"error: {args.gguf}: no such GGUF file")
    try:
        result = measure(args)
    except (OverheadError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
        sys.exit(f"error: {exc}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
