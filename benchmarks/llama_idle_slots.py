"""What llama-server's RAM prompt cache costs a server of many slots (issue 26): on every new task
it saves each idle slot's state to the cache (`--cache-idle-slots`, on by default with
`--cache-ram`), evicting the oldest entries when the cap is reached. On 2026-12-06 the H100's
deploy command (128 slots, 2048/256 tokens, the default 8192 MiB cap: ~65 entries of 126 MiB)
spent its main loop on back-to-back saves, one every 69-70 ms, from its 98th task on (1,544-1,640
evictions), and finished no request of 128 streams in 60 s.

    python benchmarks/llama_idle_slots.py MODEL.gguf [--slots 32] [--prompt-tokens 1024]
        [--output-tokens 16] [--requests 8] [--cache-ram MIB] [--ngl N] [--json OUT]

For each server setting (llama.cpp's cache as configured by `--cache-ram`, the same without idle
slot saves, no RAM cache at all), one llama-server of `--slots` slots: every slot filled with a
distinct prompt (one concurrent wave), then `--requests` more distinct prompts one at a time. Each
sequential request's wall time beside the server's own prompt and generation times: the rest is
what the server did between them (the saves). Then a second concurrent wave's output tokens/s.
The evictions are counted from the server's log. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any

from llama_decode_overhead import OverheadError, llama_server, post_concurrently, slot_tokens

from pipeline.workers.serving import post_json

EVICTION = "making room for prompt cache entry"


def settings(cache_ram: int | None) -> dict[str, list[str]]:
    """The servers compared: the RAM cache as configured (llama.cpp's default when None), the same
    without idle-slot saves, and no RAM cache (which also turns the idle-slot saves off)."""
    cap = [] if cache_ram is None else ["--cache-ram", str(cache_ram)]
    return {
        "RAM cache, idle slots saved (llama.cpp's default)": cap,
        "RAM cache, no idle-slot saves": [*cap, "--no-cache-idle-slots"],
        "no RAM cache (--cache-ram 0)": ["--cache-ram", "0"],
    }


def _prompt(i: int, n: int) -> list[int]:
    """A token-id prompt of n tokens sharing no prefix with another i < 30,000 (its first token is
    100 + i; SmolLM2's vocabulary has 49,152)."""
    return [100 + i] + [100 + (i * 7919 + j * 104729) % 20000 for j in range(1, n)]


def _wave(url: str, first: int, n: int, prompt: int, output: int) -> float:
    """n concurrent requests of distinct prompts: their output tokens/s over the wave's wall time."""
    body = {"n_predict": output, "ignore_eos": True}
    _, wall = post_concurrently(url, [{**body, "prompt": _prompt(first + i, prompt)} for i in range(n)])
    return n * output / wall


def measure_setting(gguf: Path, args: argparse.Namespace, extra: list[str], log: Path) -> dict[str, Any]:
    """One server of this setting: fill every slot, time the sequential requests, one more wave."""
    slot = slot_tokens(args.prompt_tokens, args.output_tokens)
    with llama_server(gguf, args.slots, slot, ["-ngl", str(args.ngl), *extra], log) as base:
        url = f"{base}/completion"
        _wave(url, 0, args.slots, args.prompt_tokens, args.output_tokens)  # every slot holds a prompt
        walls, server_ms = [], []
        for i in range(args.requests):
            body = {"prompt": _prompt(10_000 + i, args.prompt_tokens), "n_predict": args.output_tokens,
                    "ignore_eos": True}  # fmt: skip
            start = time.monotonic()
            got = post_json(url, body, 600)
            walls.append(1000 * (time.monotonic() - start))
            server_ms.append(got["timings"]["prompt_ms"] + got["timings"]["predicted_ms"])
        wave_tps = _wave(url, 20_000, args.slots, args.prompt_tokens, args.output_tokens)
    overhead = [w - s for w, s in zip(walls, server_ms, strict=True)]
    return {
        "server_args": extra,
        "sequential_wall_ms_median": statistics.median(walls),
        "sequential_server_ms_median": statistics.median(server_ms),
        "sequential_outside_ms_median": statistics.median(overhead),
        "wave_tokens_per_s": wave_tps,
        "evictions": log.read_text(errors="replace").count(EVICTION),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        f"{Path(result['gguf']).name}, {result['slots']} slots, {result['prompt_tokens']}/"
        f"{result['output_tokens']} tokens, -ngl {result['ngl']}, {result['requests']} sequential requests",
        "",
        "| server | request wall ms (median) | server's own ms | outside them ms | evictions logged | "
        f"wave of {result['slots']} tok/s |",
        "|---|---|---|---|---|---|",
    ]
    for name, s in result["settings"].items():
        lines.append(
            f"| {name} | {s['sequential_wall_ms_median']:.0f} | {s['sequential_server_ms_median']:.0f} | "
            f"{s['sequential_outside_ms_median']:.0f} | {s['evictions']} | {s['wave_tokens_per_s']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("gguf", type=Path)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--cache-ram", type=int, help="MiB (default: llama.cpp's own, 8192)")
    parser.add_argument("--ngl", default="0", help="layers on the GPU (all: every one)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not args.gguf.is_file():
        sys.exit(f"error: {args.gguf}: no such GGUF file")
    log_dir = (args.json or Path("/tmp/llama-idle-slots.json")).with_suffix("")
    log_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "gguf": str(args.gguf), "slots": args.slots, "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens, "requests": args.requests, "ngl": args.ngl,
        "cache_ram_mib": args.cache_ram, "settings": {},
    }  # fmt: skip
    try:
        for i, (name, extra) in enumerate(settings(args.cache_ram).items()):
            result["settings"][name] = measure_setting(args.gguf, args, extra, log_dir / f"server-{i}.log")
    except (OverheadError, FileNotFoundError, subprocess.TimeoutExpired, urllib.error.URLError) as exc:
        sys.exit(f"error: {exc}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))


if __name__ == "__main__":
    main()
