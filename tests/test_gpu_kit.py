"""The GPU host's kit (benchmarks/gpu/run_h200.sh) ends what it started by the mark its processes
carry in their environment, never by a name pattern: a stranger's process of the same name lives."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest

from pipeline.context import BuildContext
from tests.conftest import REPO

KIT = REPO / "benchmarks" / "gpu" / "run_h200.sh"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_the_kit_ends_an_earlier_calls_processes_and_no_others(tmp_path: Path) -> None:
    clean = {k: v for k, v in os.environ.items() if k != "PIPELINE_KIT_RUN"}
    # an earlier call's worker, and the engine it started in a session of its own
    pidfile = tmp_path / "engine.pid"
    worker = subprocess.Popen(
        ["bash", "-c", f"setsid sleep 301 & echo $! > {pidfile}; wait"],
        env={**clean, "PIPELINE_KIT_RUN": "1-earlier"},
        start_new_session=True,
    )
    stranger = subprocess.Popen(["sleep", "301"], env=clean)  # same name, not the kit's
    deadline = time.monotonic() + 10
    while not pidfile.is_file() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    engine = int(pidfile.read_text())
    try:
        res = subprocess.run(["bash", str(KIT), "end-earlier"], env=clean, capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        assert worker.wait(timeout=10) == -9
        deadline = time.monotonic() + 10
        while _alive(engine):
            assert time.monotonic() < deadline, "the engine in its own session outlived the kit's end"
            time.sleep(0.05)
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()


def test_each_xdist_worker_takes_its_own_gpu_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """`run_h200.sh tests` on a host with several GPUs: worker gwK sees GPU K alone."""
    from tests import conftest

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.delenv("PIPELINE_TEST_GPU_PER_WORKER", raising=False)
    conftest.pytest_configure(None)  # type: ignore[arg-type]  # the hook reads no config
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # make test's CPU workers are left alone
    monkeypatch.setenv("PIPELINE_TEST_GPU_PER_WORKER", "1")
    conftest.pytest_configure(None)  # type: ignore[arg-type]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_model_spread_over_devices_is_made_whole_in_place() -> None:
    """make-checkpoint's path for a model one GPU cannot hold (a 70B shape on four H200s), run here
    on two CPU "devices" with a tiny config: every module made straight on its device from
    uninitialised memory is fully written by scaled_init, RoPE's buffer is made again (the same as a
    normally built model's), and a float16 forward pass crosses the placement finite."""
    import importlib.util
    import sys

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "benchmarks" / "bench_gpu.py")
    assert spec and spec.loader
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    placement = bench.layer_placement(80, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])
    assert placement["model.layers.19"] == "cuda:0" and placement["model.layers.20"] == "cuda:1"
    assert placement["lm_head"] == placement["model.norm"] == "cuda:3"
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)  # fmt: skip
    model = bench.random_model(cfg, ["cpu", "cpu"])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    norms = [m.weight for n, m in model.named_modules() if n.endswith("norm")]
    assert norms and all(bool((w == 1).all()) for w in norms)  # written, not leftover memory
    reference = AutoModelForCausalLM.from_config(cfg).model.rotary_emb.inv_freq
    assert torch.equal(model.model.rotary_emb.inv_freq, reference)
    ranges = bench.activation_ranges(model, list(range(32)), torch.float16)
    assert ranges["finite"] == 1.0 and 1.0 < ranges["logits_std"] < 10.0


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_it_is_made(
    tmp_path: Path, smollm2_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device's 64 GiB disk cannot hold the 32B shape's 61 GiB beside the environments: make-checkpoint
    says so, naming the way out, before it makes a single weight (a save that fills the disk half-way
    would cost the lease). Room enough: no complaint."""
    import shutil
    import sys
    from collections import namedtuple

    import benchmarks.bench_gpu as bench

    sys.path.insert(0, str(REPO / "benchmarks"))  # make_checkpoint imports bench_trtllm_checkpoint
    assert bench.disk_shortfall(1 << 20, tmp_path) is None
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage(64 << 30, 10 << 30, 54 << 30))
    monkeypatch.setattr(bench, "random_model", lambda *_: pytest.fail("made despite the full disk"))
    with pytest.raises(SystemExit) as refused:
        bench.make_checkpoint(
            tmp_path / "ckpt" / "qwen2.5-32b-qwen2", "qwen2", smollm2_tokenizer_dir, "qwen2.5-32b"
        )
    message = str(refused.value)
    assert message.startswith("qwen2.5-32b: 61.0 GiB of bfloat16 weights, 54.0 GiB free under ")
    assert "CHECKPOINT_ROOT=/dev/shm" in message and not (tmp_path / "ckpt" / "qwen2.5-32b-qwen2").exists()


@pytest.mark.parametrize("recipe", sorted(p.name for p in (REPO / "benchmarks" / "gpu").glob("*.yaml")))
def test_each_kit_recipe_loads_once_its_checkpoint_is_made(tmp_path: Path, recipe: str) -> None:
    """The kit's recipes are checked only on the GPU host, where a mistake costs device minutes:
    each loads here with @WORK@ replaced and a checkpoint directory holding its shape's config."""
    import json

    import yaml

    from pipeline.constants import KNOWN_HUB_CONFIGS
    from pipeline.recipe import load_recipe

    text = (REPO / "benchmarks" / "gpu" / recipe).read_text().replace("@WORK@", str(tmp_path))
    source = Path(yaml.safe_load(text)["source"]["path"])
    source.mkdir(parents=True)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        **KNOWN_HUB_CONFIGS["Qwen/Qwen2-7B-Instruct"],
    }
    (source / "config.json").write_text(json.dumps(config))
    (tmp_path / recipe).write_text(text)
    loaded = load_recipe(tmp_path / recipe)
    assert loaded.recipe.targets and loaded.recipe.source.path == str(source)


def test_the_source_row_gets_the_bound_its_artifacts_get(tmp_path: Path) -> None:
    """The bf16 baseline's share of its bandwidth bound, as the artifacts' rows have theirs: here a
    tied 2-layer checkpoint (every weight read) at 512 + 128 tokens of context on an H200."""
    from safetensors.numpy import save_file

    import benchmarks.bench_gpu as bench

    tmp_path.joinpath("config.json").write_text(json.dumps(
        {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": 2}
    ))  # fmt: skip
    save_file(
        {"model.embed_tokens.weight": np.zeros((1000, 64), np.float16)}, str(tmp_path / "m.safetensors")
    )
    got = {"workloads": [{"workload": {"prompt_tokens": 512, "output_tokens": 128},
                          "levels": {"1": {"output_tokens_per_s": 1.0e7}}},
                         {"workload": {"prompt_tokens": 64, "output_tokens": 8},  # cut: a bound, no share
                          "levels": {"1": {"output_tokens_per_s": 1.0e7, "incomplete": 1}}}]}  # fmt: skip
    bench.with_bounds(got, tmp_path, "NVIDIA H200")
    bound = got["workloads"][0]["decode_bound"]
    kv = 2 * 2 * 2 * 16 * 2 * 640  # K and V, 2 layers, 2 KV heads of 16, 16-bit, 640 tokens
    assert bound["bytes_per_token"] == 1000 * 64 * 2 + kv
    assert bound["share_c1"] == round(1.0e7 / (4.8e12 / (128_000 + kv)), 4) and bound["flag"] is None
    cut = got["workloads"][1]["decode_bound"]
    assert cut["bound_tokens_per_s"] and cut["share_c1"] is None and cut["flag"] is None
    bench.with_bounds(unread := {"workloads": [{}]}, tmp_path / "absent", "NVIDIA H200")  # no checkpoint
    assert unread == {"workloads": [{}]}  # the measured rows are kept as they were


def test_a_level_its_time_cap_cut_gets_no_ratio_and_is_marked() -> None:
    """A cut level counts finished requests over the whole window (2026-12-05: every artifact's
    2048/256 levels read 128 x 256 tokens / 15 s): no ratio, and the table says how many were cut.
    Where both sides recorded what they streamed inside the cap (2026-12-07 on), that ratio is
    given instead, named as such; a level neither side cut has none."""
    import benchmarks.bench_gpu as bench

    whole = {"output_tokens_per_s": 6690.0, "planned": 512, "incomplete": 0, "streamed_tokens_per_s": 6690.0}
    cut = {"output_tokens_per_s": 2184.5, "planned": 512, "incomplete": 128, "completed": 128, "errored": 0}
    before = {**whole, "incomplete": None}  # a manifest from before the field
    levels = bench.paired_levels({"128": whole, "32": whole}, {"128": cut, "32": before})
    assert levels["32"]["ratio"] == 1.0 and levels["128"]["ratio"] is None
    assert levels["128"]["raw"]["incomplete"] == 128
    assert levels["128"]["streamed_ratio"] is None and levels["32"]["streamed_ratio"] is None  # none / uncut
    rows = [{"target": "gptq", "engine": "vllm", "serving": {"status": "passed", "workloads": [
        {"workload": {"prompt_tokens": 2048, "output_tokens": 256}, "levels": levels}]}}]  # fmt: skip
    text = bench.serving_markdown(rows, lambda v, f: format(v, f) if v is not None else "–")
    assert "| 128 | 6690.0 | 2184.5 (cut: 128 of 512 finished) | – |" in text
    assert "| 32 | 6690.0 | 6690.0 | 1.000 |" in text
    streamed = {**cut, "streamed_tokens_per_s": 4460.0}
    levels = bench.paired_levels({"128": whole}, {"128": streamed})
    assert levels["128"]["ratio"] is None and levels["128"]["streamed_ratio"] == 1.5
    rows[0]["serving"]["workloads"][0]["levels"] = levels
    text = bench.serving_markdown(rows, lambda v, f: format(v, f) if v is not None else "–")
    assert "| 2184.5 (cut: 128 of 512 finished, 4460.0 streamed) | – (streamed 1.500) |" in text


def test_the_serving_and_settings_tables_show_every_workload_and_each_setting_s_outcome() -> None:
    """The kit's results page: a row per workload and level (project beside raw, their ratio, the
    share of the bound at 1) and a row per engine setting tried, a failed one with its reason."""
    import benchmarks.bench_gpu as bench

    def level(tps: float) -> dict[str, float]:
        return {"output_tokens_per_s": tps, "ttft_ms_p50": 40.0, "ttft_ms_p99": 95.0, "itl_ms_p50": 3.5,
                "itl_ms_p99": 7.25, "peak_gpu_mib": 128_000.0}  # fmt: skip

    def run(prompt: int, output: int, share: float | None) -> dict[str, object]:
        return {
            "workload": {"prompt_tokens": prompt, "output_tokens": output},
            "decode_bound": {"share_c1": share} if share else None,
            "levels": {"8": {"project": level(900.0), "raw": level(1000.0), "ratio": 0.9},
                       "1": {"project": level(250.0), "raw": level(240.0), "ratio": 1.042}},
        }  # fmt: skip

    settings = {
        "as recorded": {"status": "passed", "env": {}, "args": [], "output_tokens_per_s": 250.0,
                        "itl_ms_p50": 3.9, "share_of_bound": 0.234, "ratio": 1.0},
        "marlin": {"status": "passed", "env": {"VLLM_DISABLED_KERNELS": "MacheteLinearKernel"},
                   "args": ["--linear-backend", "marlin"], "output_tokens_per_s": 400.0, "itl_ms_p50": 2.4,
                   "share_of_bound": 0.374, "ratio": 1.6,
                   "levels": {"8": {"concurrency": 8, "output_tokens_per_s": 2000.0, "ratio": 1.1},
                              "128": {"concurrency": 128, "output_tokens_per_s": 5400.0, "ratio": None,
                                      "incomplete": 3, "completed": 509, "planned": 512}}},
        "async scheduling": {"status": "failed", "reason": "vllm: unrecognized arguments", "env": {},
                             "args": ["--async-scheduling"]},
    }  # fmt: skip
    rows = [
        {
            "target": "gptq",
            "engine": "vllm",
            "serving": {
                "status": "passed",
                "workloads": [run(512, 128, 0.234), run(2048, 256, None)],
                "memory_setting": {"gpu_memory_utilization": 0.9},
                "kv_cache": {"tokens": 1_234_560, "mib": 67_500.0},
            },
            "settings": {"settings": settings},
        },
        {"target": "awq", "engine": "vllm", "serving": {"status": "failed", "reason": "not ready in 600 s"}},
    ]
    text = bench.serving_markdown(rows, lambda v, f: format(v, f) if v is not None else "–")
    text += bench.settings_markdown(rows, lambda v, f: format(v, f) if v is not None else "–")
    lines = text.splitlines()
    latency = "40 / 95 | 3.50 / 7.25 | 128,000"
    assert f"| gptq | vllm | 512/128 | 1 | 250.0 | 240.0 | 1.042 | {latency} | 23% |" in lines
    assert f"| gptq | vllm | 512/128 | 8 | 900.0 | 1000.0 | 0.900 | {latency} | – |" in lines
    assert f"| gptq | vllm | 2048/256 | 1 | 250.0 | 240.0 | 1.042 | {latency} | – |" in lines
    assert "| gptq | vllm | gpu_memory_utilization 0.9 | 1,234,560 tokens, 67,500 MiB |" in lines
    assert "| awq | vllm | failed: not ready in 600 s |" in lines
    assert (
        "| gptq | vllm | marlin | `VLLM_DISABLED_KERNELS=MacheteLinearKernel --linear-backend marlin` | "
        "400.0 | 1.600 | 2.40 | 37% | 8: 2000.0 (1.100); 128: 5400.0 (cut: 509 of 512 finished) (–) |"
        in lines
    )
    assert (
        "| gptq | vllm | as recorded | `–` | 250.0 | 1.000 | 3.90 | 23% | – |" in lines  # no higher level
    )
    assert any(
        line.startswith("| gptq | vllm | async scheduling | `--async-scheduling` | failed: vllm:")
        for line in lines
    )


def _kit_project(tmp_path: Path) -> tuple[object, Path]:
    """A recipe of one GGUF target benchmarked at two workloads, and its artifact directory (with
    a tokenizer, so no source is resolved)."""
    from pipeline.project import Project
    from tests.conftest import empty_checkpoint, write_recipe

    empty_checkpoint(tmp_path / "model")
    bench = {
        "enabled": True,
        "concurrency": [1, 4],
        "more_workloads": [{"prompt_tokens": 128, "output_tokens": 16}],
    }
    project = Project.open(write_recipe(tmp_path / "r.yaml", serving_benchmark=bench))
    artifact = project.layout.target_dir("gguf-f16")
    artifact.mkdir(parents=True)
    (artifact / "tokenizer.json").write_text("{}")
    return project, artifact


def _level(concurrency: int, tps: float) -> dict[str, float]:
    return {"concurrency": concurrency, "output_tokens_per_s": tps, "ttft_ms_p50": 20.0, "itl_ms_p50": 4.0}


def test_each_setting_is_the_recorded_command_with_one_change_and_a_host_override_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`settings` serves every level of the first workload only: the
    command as recorded, then each setting's arguments or environment added; a setting whose
    variable this host already sets otherwise is skipped (the load generator lets the host's
    environment win), not measured."""
    import benchmarks.bench_gpu as bench

    project, _ = _kit_project(tmp_path)
    sent: list[dict[str, object]] = []

    def load(env_name: str, request: dict, log: Path, timeout_s: float) -> dict:
        sent.append(request)
        flash = "-fa" in request["argv"]
        if flash:  # a mode line in that server's log only
            server_log = Path(request["server_log"])
            server_log.parent.mkdir(parents=True, exist_ok=True)
            server_log.write_text("warning: no usable GPU found, --gpu-layers option will be ignored\n")
        levels = [_level(1, 150.0 if flash else 100.0), _level(4, 200.0 if flash else 250.0)]
        return {"runs": [{"seconds": 1.0, "levels": levels}]}

    monkeypatch.setattr(bench, "run_step", load)
    monkeypatch.setattr(BuildContext, "program", lambda self, env, name: f"/here/{name}")  # no worker
    monkeypatch.setitem(
        bench.SERVE_SETTINGS,
        "llama.cpp",
        {"flash attention": ({}, ["-fa", "on"]), "a variable": ({"KIT_TEST_VAR": "1"}, [])},
    )
    monkeypatch.setenv("KIT_TEST_VAR", "0")
    serving = {"status": "passed", "decode_bound": {"bound_tokens_per_s": 400.0}}
    partial: list[tuple[str, list[str]]] = []  # what a lease ending mid-sweep would have kept
    got = bench.setting_rows(
        project,
        "gguf-f16",
        {"engine": "llama.cpp", "serving": {"llama.cpp": serving}},
        "llama.cpp",
        lambda so_far: partial.append((so_far["status"], list(so_far["settings"]))),
    )
    assert partial == [
        ("partial", ["as recorded"]),
        ("partial", ["as recorded", "flash attention"]),
        ("partial", ["as recorded", "flash attention", "a variable"]),
    ]
    # one shape at every level, their request counts sent beside it
    assert [r["workloads"] for r in sent] == [[{**got["workload"], "level_requests": [8, 8]}]] * 3
    assert got["workload"]["concurrency"] == [1, 4] and got["workload"]["prompt_tokens"] == 64
    recorded, flash, again = (
        [a for a, before in zip(r["argv"], [None, *r["argv"]][:-1], strict=True) if before != "--port"]
        for r in sent
    )
    assert flash == [*recorded, "-fa", "on"] and "-np" in recorded  # each on its own port
    assert recorded[0] == "/here/llama-server"  # the program where its toolchain says it is
    assert again == recorded and list(got["settings"])[-1] == "as recorded, again"  # the spread, last
    rows = got["settings"]
    assert rows["as recorded"]["ratio"] == 1.0 and rows["as recorded"]["share_of_bound"] == 0.25
    assert (
        rows["as recorded, again"]["ratio"] == 1.0
        and rows["as recorded, again"]["levels"]["4"]["ratio"] == 1.0
    )
    assert rows["flash attention"]["ratio"] == 1.5 and rows["flash attention"]["share_of_bound"] == 0.375
    assert rows["flash attention"]["levels"]["4"]["ratio"] == 0.8  # faster alone, slower at a full batch
    assert rows["flash attention"]["engine_mode"] == [
        "no usable GPU found, --gpu-layers option will be ignored"
    ]
    assert rows["as recorded"]["engine_mode"] == []  # its server logged no such line
    assert rows["as recorded"]["levels"]["4"]["output_tokens_per_s"] == 250.0
    assert "1" not in rows["as recorded"]["levels"]  # concurrency 1 is the row itself
    assert rows["a variable"]["status"] == "skipped" and "KIT_TEST_VAR" in rows["a variable"]["reason"]
    failed = bench.setting_rows(project, "gguf-f16", {"engine": "llama.cpp", "serving": {}}, "llama.cpp")
    assert failed["status"] == "not run" and len(sent) == 3  # no server started for it
    assert "serving_benchmark's engines or targets leave it out" in failed["reason"]
    # --settings: the named ones beside the command as recorded, no second run (a short lease)
    manifest = {"engine": "llama.cpp", "serving": {"llama.cpp": serving}}
    short = bench.setting_rows(project, "gguf-f16", manifest, "llama.cpp", only=["flash attention"])
    assert list(short["settings"]) == ["as recorded", "flash attention"] and len(sent) == 5
    assert short["settings"]["flash attention"]["ratio"] == 1.5
    assert bench.settings_error(["a variable", "marlin"]) is None
    assert "--settings fast: no such setting (settings: " in (bench.settings_error(["fast"]) or "")


def test_a_setting_level_a_cap_cut_is_compared_by_what_each_server_streamed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A setting's level the time cap cut has no finished-only ratio; what its server streamed inside
    the cap over what the command as recorded streamed is its ratio (2026-12-08: SGLang's mixed
    chunk at 128 streams, 335 of 512 finished against 384, streamed 0.837x), shown in the table."""
    import benchmarks.bench_gpu as bench

    project, _ = _kit_project(tmp_path)

    def load(env_name: str, request: dict, log: Path, timeout_s: float) -> dict:
        flash = "-fa" in request["argv"]
        counts = {"planned": 8, "incomplete": 2 if flash else 0, "completed": 6 if flash else 8}
        top = {
            **_level(4, 100.0 if flash else 250.0),
            **counts,
            "streamed_tokens_per_s": 180.0 if flash else 250.0,
        }
        return {"runs": [{"seconds": 1.0, "levels": [_level(1, 100.0), top]}]}

    monkeypatch.setattr(bench, "run_step", load)
    monkeypatch.setattr(BuildContext, "program", lambda self, env, name: f"/here/{name}")  # no worker
    monkeypatch.setitem(bench.SERVE_SETTINGS, "llama.cpp", {"flash attention": ({}, ["-fa", "on"])})
    manifest = {"engine": "llama.cpp", "serving": {"llama.cpp": {"status": "passed"}}}
    got = bench.setting_rows(project, "gguf-f16", manifest, "llama.cpp", only=["flash attention"])
    cut, whole = (
        got["settings"]["flash attention"]["levels"]["4"],
        got["settings"]["as recorded"]["levels"]["4"],
    )
    assert cut["ratio"] is None and cut["streamed_ratio"] == 0.72
    assert whole["ratio"] == 1.0 and whole["streamed_ratio"] is None  # neither side cut
    rows = [{"target": "gguf-f16", "engine": "llama.cpp", "settings": got}]
    text = bench.settings_markdown(rows, lambda v, f: format(v, f) if v is not None else "–")
    assert "4: 100.0 (cut: 6 of 8 finished, 180.0 streamed) (–; streamed 0.720) |" in text


def test_the_raw_side_is_compared_per_workload_and_a_failed_further_workload_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import benchmarks.bench_gpu as bench

    project, _ = _kit_project(tmp_path)
    raw = {"runs": [{"seconds": 9.0, "levels": [_level(1, 200.0), _level(4, 500.0)]},
                    {"error": "the server died during the benchmark: out of memory"}]}  # fmt: skip
    monkeypatch.setattr(bench, "run_step", lambda *a, **k: raw)
    monkeypatch.setattr(BuildContext, "program", lambda self, env, name: f"/here/{name}")  # no worker
    levels = {"1": _level(1, 190.0), "4": _level(4, 520.0)}
    ours = {
        "status": "passed",
        "workload": {"prompt_tokens": 64, "output_tokens": 32},
        "levels": levels,
        "more_workloads": [{"workload": {"prompt_tokens": 128, "output_tokens": 16}, "levels": levels}],
    }
    got = bench.serving_rows(
        project, "gguf-f16", {"engine": "llama.cpp", "serving": {"llama.cpp": ours}}, "llama.cpp"
    )
    first, second = got["workloads"]
    assert first["levels"]["1"]["ratio"] == 0.95 and first["levels"]["4"]["ratio"] == 1.04
    assert first["reason"] is None
    assert second["levels"]["1"]["ratio"] is None and "out of memory" in second["reason"]


def test_a_raw_serving_step_may_name_its_engine() -> None:
    """`serve:sglang` runs that engine's raw server only (its place in the list is its turn);
    `serve` and `settings` run every benchmarked engine's; build steps are not serving steps."""
    import benchmarks.bench_gpu as bench

    assert bench.serving_op("serve") == ("serve", None)
    assert bench.serving_op("serve:sglang") == ("serve", "sglang")
    assert bench.serving_op("settings:vllm") == ("settings", "vllm")
    assert bench.serving_op("quantize") == (None, None)
    assert bench.serving_op("validate:sglang") == (None, None)
    # a lease is too short for a raw step that silently does nothing, or the same server twice
    assert bench.raw_steps_error(["quantize", "serve:sglang", "serve:vllm", "settings"]) is None
    assert "no engine 'sglnag'" in (bench.raw_steps_error(["serve:sglnag"]) or "")
    for twice in (["serve", "serve:sglang"], ["serve:sglang", "serve"], ["settings:vllm", "settings:vllm"]):
        assert "twice for one engine" in (bench.raw_steps_error(twice) or "")
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "bench_gpu.py"), "run", "r.yaml", "--targets", "awq",
         "--model", "m", "--json", "o.json", "--raw-steps", "serve:sglnag"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 2 and "no engine 'sglnag'" in run.stderr


def test_a_serving_only_run_builds_without_force_and_keeps_an_up_to_date_artifact(tmp_path: Path) -> None:
    """Build steps compared with the raw tools: every file made anew (`--force`). A serving-only run
    (`none`, `serve`, `settings`) builds as a build server does, so a changed CONCURRENCY keeps the
    verified files (2026-12-07 it quantized Q4_0 again; IQ4_XS takes ~127 s); an up-to-date
    artifact's manifest stands, one a failed build left behind does not."""
    import benchmarks.bench_gpu as bench

    recipe = Path("r.yaml")
    assert bench.build_argv(recipe, "gguf-q4_0", ["quantize", "serve"])[-1] == "--force"
    for serving_only in ([], ["serve:llama.cpp"], ["settings:vllm", "serve"]):
        assert "--force" not in bench.build_argv(recipe, "gguf-q4_0", serving_only)
    manifest = tmp_path / "manifest.json"
    forced, kept = bench.build_argv(recipe, "t", ["quantize"]), bench.build_argv(recipe, "t", ["serve"])
    assert not bench.this_builds_manifest(manifest, 0.0, kept, 0)  # none at all
    manifest.write_text("{}")
    written = manifest.stat().st_mtime
    assert bench.this_builds_manifest(manifest, written - 1, forced, 7)  # its own (a failed verdict)
    later = written + 1  # a manifest from before this build began
    assert bench.this_builds_manifest(manifest, later, kept, 0)  # up to date
    assert not bench.this_builds_manifest(manifest, later, kept, 5)  # the build failed
    assert not bench.this_builds_manifest(manifest, later, forced, 0)


def test_a_run_the_lease_ended_gets_its_project_side_and_a_raw_side_not_run(tmp_path: Path) -> None:
    """`close`: a benchmarked engine's row takes the project's levels from the collected manifest
    and no ratio; an engine whose benchmark did not pass keeps its record; another target's row and
    a row that already has a serving record are left as they are."""
    import benchmarks.bench_gpu as bench

    level = {"concurrency": 1, "output_tokens_per_s": 230.0, "ttft_ms_p50": 28.0, "itl_ms_p50": 4.1,
             "planned": 32, "completed": 32, "incomplete": 0}  # fmt: skip
    passed = {"status": "passed", "workload": {"prompt_tokens": 512, "output_tokens": 128},
              "levels": {"1": level}, "device": "H100", "kv_cache": {"tokens": 9}}  # fmt: skip
    skipped = {"status": "skipped", "reason": "sglang: failed"}
    manifest = {"target": "awq", "engine": "vllm", "serving": {"vllm": passed, "sglang": skipped}}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    kept = {"status": "passed", "workloads": []}
    base = {"model": "m", "status": "passed", "device": "H100", "primary": True}
    rows = [{**base, "target": "awq", "engine": "vllm"}, {**base, "target": "awq", "engine": "sglang"},
            {**base, "target": "gptq", "engine": "vllm"}, {**base, "target": "awq", "engine": "llama.cpp",
            "serving": kept}]  # fmt: skip
    results = tmp_path / "run.json"
    results.write_text(json.dumps(rows))
    bench.close_rows(results, [tmp_path / "manifest.json"], "the lease ended")
    vllm, sglang, gptq, llama = json.loads(results.read_text())
    record = vllm["serving"]
    assert (record["status"], record["raw_status"]) == ("passed", "not run")
    assert record["raw_reason"] == "the lease ended"
    one = record["workloads"][0]["levels"]["1"]
    assert one["project"]["output_tokens_per_s"] == 230.0 and one["ratio"] is None
    assert one["raw"]["output_tokens_per_s"] is None
    assert sglang["serving"] == skipped
    assert "serving" not in gptq and llama["serving"] == kept


def test_a_bundle_of_some_environments_is_carried_apart_from_the_whole_set(tmp_path: Path) -> None:
    """`carry.sh pack DIR core guidellm` with PACK_DIR packs only those environments, beside the
    whole set in .whl/, and `append` with CARRY_DIR copies that bundle's parts and the .whl/ extras
    (the CUDA tools) into the scratch dir, where the parts join to what was packed."""
    carry = REPO / "benchmarks" / "gpu" / "carry.sh"
    wheels = tmp_path / "wheels"
    for env in ("core", "guidellm", "vllm"):
        (wheels / env).mkdir(parents=True)
        (wheels / env / f"{env}-1.0-py3-none-any.whl").write_bytes(os.urandom(3000))
    checkout, scratch = tmp_path / "checkout", tmp_path / "scratch"
    checkout.mkdir()
    env = {**os.environ, "PART_BYTES": "4k", "PIPELINE_CARRY_SCRATCH": str(scratch)}

    def sh(*args: str, **extra: str) -> None:
        subprocess.run(["bash", str(carry), *args], cwd=checkout, env={**env, **extra}, check=True,
                       capture_output=True)  # fmt: skip

    sh("pack", str(wheels))
    sh("pack", str(wheels), "core", "guidellm", PACK_DIR=".whl-gguf")
    parts = {d: len(list((checkout / d).glob("part.*"))) for d in (".whl", ".whl-gguf")}
    assert parts[".whl"] > parts[".whl-gguf"] > 1
    (checkout / ".whl" / "llama-cuda-tools.tgz").write_bytes(b"tools")
    sh("append", CARRY_DIR=".whl-gguf")
    assert sorted(p.name for p in scratch.iterdir() if not p.name.startswith("part.")) == [
        "bundle.sha256",
        "llama-cuda-tools.tgz",
    ]
    joined = b"".join(p.read_bytes() for p in sorted(scratch.glob("part.*")))
    assert hashlib.sha256(joined).hexdigest() == (scratch / "bundle.sha256").read_text().strip()
    with tarfile.open(fileobj=io.BytesIO(joined)) as bundle:
        names = bundle.getnames()
    assert {n.split("/")[0] for n in names} == {"core", "guidellm"}


def test_the_validation_kernels_come_from_the_engines_build_log_sections_and_its_server_log(
    tmp_path: Path,
) -> None:
    import benchmarks.bench_gpu as bench

    assert bench._kernels(tmp_path, "awq", "sglang") == []  # no logs at all: nothing named, no error
    (tmp_path / "awq.log").write_text(
        "header\n=== pipeline.workers.vllm op=validate\n"
        "Using MacheteLinearKernel for CompressedTensorsWNA16\n"
        "=== pipeline.workers.sglang op=validate\n"
        "The model is convertible to gptq_marlin during runtime. Using gptq_marlin kernel.\n"
        "=== pipeline.workers.sglang op=serve_check\nUsing awq kernel\n"
    )
    # only the engine's validate sections of the build log; no server log written: no error
    assert bench._kernels(tmp_path, "awq", "sglang") == ["gptq_marlin"]
    (tmp_path / "awq-sglang-server.log").write_bytes(b"\xff [2026-12-05] Using awq_marlin kernel\n")
    assert bench._kernels(tmp_path, "awq", "sglang") == ["gptq_marlin", "awq_marlin"]
    assert bench._kernels(tmp_path, "awq", "vllm") == ["MacheteLinearKernel for CompressedTensorsWNA16"]
    # a kernel the engine could have used but was told not to is no kernel it chose (SGLang 0.5.17
    # named `--quantization gptq`); vLLM's FP8 kernel is "Selected"; llama.cpp names none
    (tmp_path / "gptq.log").write_text(
        "header\n=== pipeline.workers.sglang op=validate\nDetected that the model can run with gptq_marlin, "
        "however you specified quantization=gptq explicitly, so forcing gptq.\n"
        "=== pipeline.workers.vllm op=validate\n"
        "INFO [modelopt.py:512] Selected CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod\n"
        "=== pipeline.workers.llamacpp op=validate\nload_tensors: offloaded 29/29 layers to GPU\n"
    )
    assert bench._kernels(tmp_path, "gptq", "sglang") == []
    fp8 = "CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod"
    assert bench._kernels(tmp_path, "gptq", "vllm") == [fp8]
    assert bench._kernels(tmp_path, "gptq", "llama.cpp") == []
