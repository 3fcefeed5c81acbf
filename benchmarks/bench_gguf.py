"""GGUF benchmark: prints numbers, asserts nothing.

(a) `pipeline build` of the default recipe's Q4_0 target (cold artifacts dir: F16 conversion,
    quantization, reference, validation) against the same convert + quantize run by hand, in one
    run, as ratios.
(b) peak RSS of llama.cpp's HF->GGUF converter on synthetic random-weight checkpoints with
    Qwen2-0.5B/1.5B shapes (151936 vocab, sharded fp16 safetensors), written as Llama
    architecture with SmolLM2's tokenizer (declared as qwen2, the converter rejected that tokenizer:
    "BPE pre-tokenizer was not recognized"): memory should track the largest tensor, not the model.

Usage: .venv/bin/python benchmarks/bench_gguf.py [--sizes 0.5b,1.5b] [--workdir bench-out]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
CONVERTER = Path(sys.prefix) / "share" / "pipeline" / "llama.cpp" / "convert_hf_to_gguf.py"

# Qwen2 shapes (hidden, intermediate, layers, heads, kv heads); vocab 151936, tied embeddings.
SHAPES = {"0.5b": (896, 4864, 24, 14, 2), "1.5b": (1536, 8960, 28, 12, 2)}
VOCAB = 151936
SHARD_BYTES = 1 << 30


def default_source(work: Path) -> Path:
    """The default recipe's source checkpoint (materialised SmolLM2), as the pipeline resolves it."""
    from pipeline.recipe import load_recipe
    from pipeline.source import resolve_source

    return resolve_source(load_recipe(REPO / "recipes" / "smollm2-135m.yaml"), work / "source.log").path


def run_measured(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, int, int]:
    """(wall seconds, peak RSS bytes of the process, exit code) via wait4's rusage."""
    wall, peaks, code = run_sampled(cmd, env)
    return wall, peaks["maxrss"], code


def run_sampled(cmd: list[str], env: dict[str, str] | None = None) -> tuple[float, dict[str, int], int]:
    """Wall time, exit code and memory peaks of one process: wait4's ru_maxrss, plus the peaks of
    anonymous and file-backed RSS sampled every 20 ms from /proc (mmapped safetensors pages count
    in RSS but are reclaimable page cache, not memory the converter holds)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    peaks = {"RssAnon": 0, "RssFile": 0}
    status_file = Path(f"/proc/{proc.pid}/status")
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        try:
            for line in status_file.read_text().splitlines():
                key, _, value = line.partition(":")
                if key in peaks:
                    peaks[key] = max(peaks[key], int(value.split()[0]) * 1024)
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    proc.returncode = os.waitstatus_to_exitcode(status)
    peaks["maxrss"] = usage.ru_maxrss * 1024
    return time.perf_counter() - t0, peaks, proc.returncode


def bench_build_vs_hand(work: Path) -> None:
    print("== (a) pipeline build gguf-q4_0 vs convert + quantize by hand (SmolLM2-135M)")
    root = work / "artifacts"
    shutil.rmtree(root, ignore_errors=True)
    env = {**os.environ, "PIPELINE_ARTIFACTS": str(root)}
    recipe = REPO / "recipes" / "smollm2-135m.yaml"
    cmd = [sys.executable, "-m", "pipeline.cli", "build", str(recipe), "--targets", "gguf-q4_0"]
    wall_pipeline, _, rc = run_measured(cmd, env)
    if rc != 0:
        raise SystemExit(f"pipeline build failed with exit code {rc}")
    manifest = json.loads((root / "smollm2-135m" / "gguf-q4_0" / "manifest.json").read_text())
    source = default_source(work)
    f16, q4 = work / "hand-f16.gguf", work / "hand-q4_0.gguf"
    conv = [sys.executable, str(CONVERTER), str(source), "--outfile", str(f16), "--outtype", "f16"]
    wall_convert, _, rc1 = run_measured(conv)
    quant = [
        sys.executable,
        "-c",
        "import ctypes, sys, llama_cpp\n"
        "p = llama_cpp.llama_model_quantize_default_params()\n"
        "p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0\n"
        "src, dst = (a.encode() for a in sys.argv[1:3])\n"
        "sys.exit(llama_cpp.llama_model_quantize(src, dst, ctypes.byref(p)))",
        str(f16),
        str(q4),
    ]
    wall_quant, _, rc2 = run_measured(quant)
    if rc1 or rc2:
        raise SystemExit("hand-run convert/quantize failed")
    hand = wall_convert + wall_quant
    build_s = manifest["build"]["seconds"]
    print(f"  by hand: convert {wall_convert:.1f}s + quantize {wall_quant:.1f}s = {hand:.1f}s")
    print(f"  pipeline build step (manifest build.seconds): {build_s:.1f}s  ratio {build_s / hand:.2f}x")
    print(
        f"  pipeline build whole command (source hash, toolchain probe, reference, validation): "
        f"{wall_pipeline:.1f}s  ratio {wall_pipeline / hand:.2f}x"
    )
    same = (root / "smollm2-135m" / "gguf-q4_0" / "model.gguf").stat().st_size == q4.stat().st_size
    print(f"  same Q4_0 file size as by hand: {same}")


def write_checkpoint(out: Path, size: str, tokenizer_dir: Path) -> tuple[int, int]:
    """Random fp16 weights of Qwen2 shapes in ~1 GiB shards; returns (params, largest tensor bytes)."""
    from safetensors.numpy import save_file

    hidden, inter, layers, heads, kv = SHAPES[size]
    head_dim = hidden // heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shard: dict[str, np.ndarray] = {}
    shard_bytes, weight_map, n_shards = 0, {}, 0

    def flush() -> None:
        nonlocal shard, shard_bytes, n_shards
        n_shards += 1
        name = f"model-{n_shards:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        arr = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)
        if shard_bytes + arr.nbytes > SHARD_BYTES and shard:
            flush()
        shard[name] = arr
        shard_bytes += arr.nbytes
    flush()
    total = sum(int(np.prod(s)) for s in shapes.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total * 2}, "weight_map": weight_map})
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": VOCAB,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (out / "config.json").write_text(json.dumps(config))
    for f in tokenizer_dir.iterdir():  # SmolLM2's tokenizer; the converter pads the vocab
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return total, max(int(np.prod(s)) for s in shapes.values()) * 2


def bench_convert_rss(work: Path, sizes: list[str]) -> None:
    print("== (b) peak RSS of convert_hf_to_gguf.py --outtype f16 on sharded fp16 checkpoints")
    tokenizer_dir = default_source(work)
    print(
        f"  {'model':>6} {'params':>8} {'on disk':>9} {'largest tensor':>15} "
        f"{'peak anon RSS':>14} {'peak file RSS':>14} {'ru_maxrss':>10} {'wall':>6}"
    )
    for size in sizes:
        ckpt = work / f"synthetic-{size}"
        shutil.rmtree(ckpt, ignore_errors=True)
        params, largest = write_checkpoint(ckpt, size, tokenizer_dir)
        on_disk = sum(p.stat().st_size for p in ckpt.glob("*.safetensors"))
        out = work / f"synthetic-{size}.gguf"
        wall, peaks, rc = run_sampled(
            [sys.executable, str(CONVERTER), str(ckpt), "--outfile", str(out), "--outtype", "f16"]
        )
        if rc:
            raise SystemExit(f"converter failed on {size} (exit {rc})")
        gib = 1 << 30
        print(
            f"  {size:>6} {params / 1e9:>7.2f}B {on_disk / gib:>8.2f}G {largest / gib:>14.2f}G "
            f"{peaks['RssAnon'] / gib:>13.2f}G {peaks['RssFile'] / gib:>13.2f}G "
            f"{peaks['maxrss'] / gib:>9.2f}G {wall:>5.0f}s"
        )
        shutil.rmtree(ckpt)
        out.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="0.5b,1.5b")
    parser.add_argument("--workdir", default=str(REPO / "bench-out"))
    parser.add_argument("--skip-build", action="store_true", help="only run (b)")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    if not args.skip_build:
        bench_build_vs_hand(work)
    bench_convert_rss(work, [s for s in args.sizes.split(",") if s])


if __name__ == "__main__":
    main()
