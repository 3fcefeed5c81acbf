"""The memory-bandwidth bound of decoding at batch 1 ("speed of light"): each output token reads
every weight the decoder multiplies by once (as stored: quantized bytes, scales and zeros
included) plus the KV cache of the context so far, so tokens/s <= bandwidth / bytes per token.
The serving benchmark records each artifact's bytes per token, the bound on the host's GPU
(the spec's bandwidth, named) and concurrency 1's share of it (pipeline.serving)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

from pipeline.constants import GPU_MEMORY_BANDWIDTH_GBS
from pipeline.manifest import DecodeBound

KV_BYTES = 2  # a 16-bit KV cache: the engines' default (vLLM `auto`, llama.cpp f16, SGLang auto)
# below this share of its bound at concurrency 1 on an idle GPU, an artifact is flagged: the
# decode path is not bandwidth-bound (a wrong kernel, eager mode, per-token overhead)
LOW_SHARE = 0.30
# the input embedding: one row is read per token, not the table (unless the output head is tied to it)
EMBEDDING_NAMES = ("model.embed_tokens.weight", "embed_tokens.weight", "token_embd.weight")
OUTPUT_NAMES = ("lm_head.weight", "output.weight")


def safetensors_tensor_bytes(model_dir: Path) -> dict[str, int]:
    """Every tensor's stored size in bytes, from the checkpoint's safetensors headers (an 8-byte
    little-endian header length, a JSON header with each tensor's data offsets)."""
    sizes: dict[str, int] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                sizes[name] = end - start
    return sizes


def weights_read_per_token(tensor_bytes: dict[str, int]) -> int:
    """Bytes of weights one decoded token reads: everything but the input embedding table, which
    counts once when no separate output head exists (tied: the head reads the whole table)."""
    total = sum(tensor_bytes.values())
    embedding = next((tensor_bytes[n] for n in EMBEDDING_NAMES if n in tensor_bytes), 0)
    tied = not any(n in tensor_bytes for n in OUTPUT_NAMES)
    return total if tied else total - embedding


def checkpoint_weights_read(model_dir: Path) -> int:
    """weights_read_per_token of a safetensors checkpoint (0 where it has none)."""
    return weights_read_per_token(safetensors_tensor_bytes(model_dir))


def kv_bytes_per_context_token(config: dict) -> int:
    """K and V of one token in every layer, 16-bit (the model's Hugging Face config.json)."""
    text = config.get("text_config", config)  # multimodal configs nest the decoder's
    heads = text["num_attention_heads"]
    head_dim = text.get("head_dim") or text["hidden_size"] // heads
    kv_heads = text.get("num_key_value_heads") or heads
    return 2 * text["num_hidden_layers"] * kv_heads * head_dim * KV_BYTES


def decode_bound(
    weights_bytes: int,
    kv_per_token: int,
    context_tokens: int,
    gpu_name: str | None,
    tokens_per_s_c1: float | None,
    engine_mode: list[str] | None = None,
    gpu_layers: tuple[int, int] | None = None,
) -> DecodeBound:
    """The bound on `gpu_name` (None: a CPU host, no bandwidth figure) with the KV cache of
    `context_tokens`, and the measured concurrency-1 output tokens/s as a share of it; a flag below
    LOW_SHARE names the kernels and mode its server logged (`engine_mode`). `gpu_layers`: (on the
    GPU, of all) where the deploy command offloads only some layers: part of every token then reads
    host memory, so the GPU's bandwidth bounds nothing and no share or flag is given."""
    per_token = weights_bytes + kv_per_token * context_tokens
    offload = gpu_layers if gpu_name and gpu_layers and gpu_layers[0] < gpu_layers[1] else None
    bandwidth = GPU_MEMORY_BANDWIDTH_GBS.get(gpu_name) if gpu_name and not offload else None
    bound = bandwidth * 1e9 / per_token if bandwidth else None
    share = tokens_per_s_c1 / bound if bound and tokens_per_s_c1 is not None else None
    if offload:
        source = f"{offload[0]} of {offload[1]} layers on {gpu_name}, the rest in host memory: no one bound"
    elif bandwidth:
        source = f"spec: {gpu_name} {bandwidth:g} GB/s"
    elif gpu_name:
        source = f"no bandwidth figure for {gpu_name} (pipeline.constants.GPU_MEMORY_BANDWIDTH_GBS)"
    else:
        source = "a CPU host: no bandwidth figure"
    low = share is not None and share < LOW_SHARE
    return DecodeBound(
        weights_bytes=weights_bytes,
        kv_bytes=kv_per_token * context_tokens,
        context_tokens=context_tokens,
        bytes_per_token=per_token,
        bandwidth_gbs=bandwidth,
        bandwidth_from=source,
        bound_tokens_per_s=round(bound, 1) if bound else None,
        share_c1=round(share, 4) if share is not None else None,
        gpu_layer_share=round(offload[0] / offload[1], 4) if offload else None,
        flag=(
            f"below {LOW_SHARE:.0%} of its bandwidth bound at concurrency 1: not bandwidth-bound, "
            + (
                f"decoding with {'; '.join(engine_mode)}"
                if engine_mode
                else "its server logged no kernel or mode line"
            )
        )
        if low
        else None,
    )
