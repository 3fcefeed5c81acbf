"""The serving benchmark, inside the `guidellm` environment: start the artifact's serve command
(`python` as its engine environment's interpreter, llama-server as the core located it) on a free
loopback port, wait until it answers, then per workload one warm-up request of its shape and one
GuideLLM run over the concurrency levels (synthetic prompts of a fixed length, a bounded request
count), sampling the server's process-group memory, and shut the server down whatever happens."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pipeline.workers.protocol import (
    UsageSampler,
    dying_with_parent,
    exit_reason,
    installed_versions,
    last_error_line,
    worker_main,
)
from pipeline.workers.serving import post_json, run_argv

MIB = 1024**2
# one request of the workload's shape; the load step's own limit (pipeline.serving.load_timeout_s)
# allows a level's time for it and ends the step first where that is shorter
WARM_UP_TIMEOUT_S = 300


def op_toolchain(req: dict[str, Any]) -> dict[str, Any]:
    return {"toolchain": installed_versions("guidellm", "transformers")}


def wait_ready(server: subprocess.Popen[bytes], base: str, log: Path, timeout_s: float) -> str:
    """The served model id once GET /v1/models answers; a one-line error if the server exits or
    stays silent for timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (why := exit_reason(server, log)) is not None:
            raise RuntimeError(f"the server exited with code {server.returncode} before it was ready: {why}")
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
                return json.loads(r.read())["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            time.sleep(1)
    raise RuntimeError(f"the server was not ready within {timeout_s:.0f} s (log: {log})")


def warm_up_prompt(tokenizer: Any, tokens: int) -> str:
    """A text of at most `tokens` tokens as `tokenizer` encodes it again (special tokens apart; the
    server adds its BOS, as to GuideLLM's prompts): the warm-up's prompt at the workload's length."""
    unit = tokenizer.encode(" The quick brown fox jumps over the lazy dog.", add_special_tokens=False)
    ids = (unit * (tokens // len(unit) + 1))[:tokens]
    text = tokenizer.decode(ids)
    while len(tokenizer.encode(text, add_special_tokens=False)) > tokens:  # a merge across the cut
        ids = ids[:-1]
        text = tokenizer.decode(ids)
    return text


def _warm_up(
    server: subprocess.Popen[bytes], base: str, model_id: str, prompt: str, tokens: int, log: Path
) -> None:
    """One request of the workload's shape before measuring it (all `tokens` generated, as GuideLLM
    asks: ignore_eos): the first request pays for paging the weights in (and for compiling, on vLLM),
    and the first at a workload's length for what the engine builds on first use (H100, 2026-12-07:
    SGLang with FlashInfer attention, whose "Hello" warm-up left ~5 s in level 1's first 512-token
    request): the server's start, not its serving."""
    body = {"model": model_id, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
    try:
        post_json(f"{base}/v1/completions", body, timeout=WARM_UP_TIMEOUT_S)
    except (OSError, ValueError, http.client.HTTPException) as exc:
        if (why := exit_reason(server, log)) is not None:
            raise RuntimeError(f"the server died before the warm-up request answered: {why}") from None
        raise RuntimeError(f"the warm-up request failed: {exc!r}") from None


def _stop(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, SIGKILL what is left after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(server.pid, sig)
        except ProcessLookupError:
            return
        try:
            server.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def op_benchmark(req: dict[str, Any]) -> dict[str, Any]:
    workloads = req["workloads"]
    port = req["port"]  # the one the core built the argument list for
    base = f"http://127.0.0.1:{port}"
    argv = run_argv(req["argv"], req["model_dir"], python=req["python"])
    log = Path(req["server_log"])
    from transformers import AutoTokenizer  # (the guidellm set's: GuideLLM reads it too)

    try:  # before the server's start: a tokenizer that cannot load wastes none
        tokenizer = AutoTokenizer.from_pretrained(req["tokenizer"])
    except (OSError, ValueError) as exc:
        raise RuntimeError(f"the tokenizer at {req['tokenizer']} did not load: {exc}") from None
    t0 = time.perf_counter()
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in req.get("server_env", {}).items()}}
    with log.open("wb") as sink:
        server = subprocess.Popen(
            dying_with_parent(argv), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
    try:
        model_id = wait_ready(server, base, log, req["ready_timeout_s"])
        ready_s = time.perf_counter() - t0

        def measure(workload: dict[str, Any]) -> dict[str, Any]:
            prompt = warm_up_prompt(tokenizer, workload["prompt_tokens"])
            _warm_up(server, base, model_id, prompt, workload["output_tokens"], log)
            return _measure(server, base, model_id, req["tokenizer"], workload, log)

        runs = [measure(workloads[0])]
        for workload in workloads[1:]:  # a later shape that fails keeps the earlier ones' numbers
            try:
                runs.append(measure(workload))
            except RuntimeError as exc:
                runs.append({"error": str(exc)})
                runs += [{"error": "not run: a workload before it failed"} for _ in workloads[len(runs) :]]
                break
    finally:
        _stop(server)
    version = installed_versions("guidellm").get("guidellm")
    return {
        "tool": f"guidellm {version}",
        "server_ready_s": ready_s,
        "seconds": time.perf_counter() - t0,
        "runs": runs,
    }


def _measure(
    server: subprocess.Popen[bytes],
    base: str,
    model_id: str,
    tokenizer: str,
    workload: dict[str, Any],
    log: Path,
) -> dict[str, Any]:
    """One GuideLLM run of `workload` against the running server: its seconds and each level's
    numbers with the server's peak memory and the other processes' CPU share meanwhile."""
    t0 = time.perf_counter()
    with UsageSampler(server.pid, interval_s=0.2) as usage:
        try:
            report = _run_guidellm(base, model_id, tokenizer, workload)
        finally:
            if (why := exit_reason(server, log)) is not None:
                raise RuntimeError(f"the server died during the benchmark: {why}")
    levels = []
    for level, (start, end) in parse_report(report, workload["level_requests"]):
        rss, gpu = usage.peaks(start, end)
        levels.append(
            {
                **level,
                "peak_rss_mib": round(rss / MIB, 1),
                "peak_gpu_mib": gpu,
                "others_cpu_share": usage.others_cpu_share(start, end),
            }
        )
    shape = f"{workload['prompt_tokens']}/{workload['output_tokens']} tokens"
    for level in levels:
        # a level the time cap ended before any request finished is a measurement (cut, none
        # finished: 2048/256 at 128 streams on llama-server, 2026-12-06); one whose requests all
        # errored, or that sent none, is not
        if not level["completed"] and not level["incomplete"]:
            what = f"{level['errored']} errored" if level["errored"] else "no request was sent"
            raise RuntimeError(
                f"no request succeeded at concurrency {level['concurrency']} with {shape} "
                f"({what}; server log: {log})"
            )
    return {"seconds": time.perf_counter() - t0, "levels": levels}


# GuideLLM 0.8 ends a run with this when a level's accumulator got no update from its request
# workers although the server answered (its own log: "successful=0" at compile, the requests 200 OK
# in the server's): seen twice in the CI of 2026-12-06 on a 2-request level, never alone
LOST_UPDATES = "No measurement start or end times available"


def _run_guidellm(base: str, model_id: str, tokenizer: str, workload: dict[str, Any]) -> dict[str, Any]:
    """One GuideLLM run over every concurrency level; its JSON report (run once more, said so, where
    GuideLLM lost a level's request updates: LOST_UPDATES)."""
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        report = Path(tmp) / "report.json"
        argv = guidellm_argv(base, model_id, tokenizer, workload, report)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        limit_s = (workload["max_seconds_per_level"] + 30) * len(workload["concurrency"])
        for attempt in (1, 2):
            try:
                done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=limit_s)
            except subprocess.TimeoutExpired:
                raise RuntimeError(f"guidellm did not finish within {limit_s:.0f} s") from None
            sys.stdout.write(done.stdout[-4000:] + done.stderr[-4000:])
            if attempt == 1 and done.returncode != 0 and LOST_UPDATES in done.stderr + done.stdout:
                print(
                    f"guidellm lost a level's request updates ({LOST_UPDATES}): running it once more",
                    flush=True,
                )
                continue
            break
        if done.returncode != 0 or not report.is_file():
            why = last_error_line(done.stderr + done.stdout)
            raise RuntimeError(f"guidellm exited with code {done.returncode}: {why}")
        return json.loads(report.read_text())


def guidellm_argv(
    base: str, model_id: str, tokenizer: str, workload: dict[str, Any], report: Path
) -> list[str]:
    """GuideLLM 0.8's `run`: streamed OpenAI completions (TTFT and inter-token latency measured),
    synthetic prompts of a fixed length, fixed concurrencies, each level its own request count
    (whole waves, the core's `level_requests`; `constraints[0]` is max_requests) and a duration cap.
    Readiness is asked of /v1/models, which every engine's server answers once its model is loaded."""
    levels = workload["concurrency"]
    counts = workload["level_requests"]
    return [
        sys.executable, "-m", "guidellm", "run",  # no console script where the set is carried (--target)
        "--backend", f"kind=openai_http,target={base},model={model_id},request_format=/v1/completions,"
                     "stream=true,timeout=120,api_routes./health=v1/models",
        "--profile", f"kind=concurrent,streams={levels[0]}",
        "--override", "profile.streams", ",".join(str(c) for c in levels),
        "--constraint", f"kind=max_requests,count={counts[0]}",
        "--override", "constraints[0].count", ",".join(str(n) for n in counts),
        "--constraint", f"kind=max_duration,seconds={workload['max_seconds_per_level']}",
        "--data", f"kind=synthetic_text,prompt_tokens={workload['prompt_tokens']},"
                  f"output_tokens={workload['output_tokens']}",
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--seed", f"kind=static,value={workload['seed']}",
        "--output", f"kind=json,path={report}",
        "--disable-console",
    ]  # fmt: skip


def streamed_tokens_per_s(rates: dict[str, Any]) -> float:
    """The finished and the cut requests' output tokens over a level's window, from GuideLLM's
    output_tokens_per_second (each status's mean is its tokens over the same window; errored
    requests' are left out, as in output_tokens_per_s). Checked on llama-server (2026-12-07, SmolLM2
    Q4_0, 4 streams of 256-token prompts cut at 6 s): its log's cancelled tasks held 1,257 tokens,
    233 past the prompts; GuideLLM counted 231 streamed, 226 of them inside the window."""
    return sum((rates.get(status) or {}).get("mean") or 0.0 for status in ("successful", "incomplete"))


def parse_report(
    report: dict[str, Any], counts: list[int]
) -> list[tuple[dict[str, Any], tuple[float, float]]]:
    """Each level's numbers (latencies in ms) and its (start, end) wall-clock times; `counts`, the
    requests each level was to run."""
    if len(report["benchmarks"]) != len(counts):
        raise RuntimeError(f"guidellm ran {len(report['benchmarks'])} levels, {len(counts)} were asked")
    levels = []
    for bench, planned in zip(report["benchmarks"], counts, strict=True):
        m = bench["metrics"]

        def pct(key: str, p: str, m: dict[str, Any] = m) -> float | None:
            return m[key]["successful"]["percentiles"].get(p)

        level = {
            "concurrency": bench["config"]["strategy"]["streams"],
            "completed": m["request_totals"]["successful"],
            "errored": m["request_totals"]["errored"],
            "planned": planned,
            # requests the duration cap cut off: their tokens are not counted, the window is
            "incomplete": m["request_totals"]["incomplete"],
            "ttft_ms_p50": pct("time_to_first_token_ms", "p50"),
            "ttft_ms_p99": pct("time_to_first_token_ms", "p99"),
            "itl_ms_p50": pct("inter_token_latency_ms", "p50"),
            "itl_ms_p99": pct("inter_token_latency_ms", "p99"),
            # `successful`, not `total`: total counts errored requests as served ones
            "output_tokens_per_s": m["output_tokens_per_second"]["successful"]["mean"],
            # what the server streamed inside the window, the requests a time cap cut included
            # (GuideLLM places each streamed token at its arrival; a rate's mean is the tokens over
            # the window): a cut level's production, where output_tokens_per_s counts finished ones
            "streamed_tokens_per_s": streamed_tokens_per_s(m["output_tokens_per_second"]),
            # the answers' length: the workload's output_tokens when the server honoured ignore_eos
            # and no answer was cut short (an interrupted stream ends early and counts fewer)
            "output_tokens_mean": m["output_token_count"]["successful"]["mean"],
            "requests_per_s": m["requests_per_second"]["successful"]["mean"],
        }
        if not level["completed"]:  # nothing finished: no latency to report, no tokens counted
            level.update(dict.fromkeys(("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")))
            level.update(output_tokens_per_s=0.0, requests_per_s=0.0, output_tokens_mean=None)
        levels.append((level, (bench["start_time"], bench["end_time"])))
    return levels


if __name__ == "__main__":
    worker_main({"toolchain": op_toolchain, "benchmark": op_benchmark})
