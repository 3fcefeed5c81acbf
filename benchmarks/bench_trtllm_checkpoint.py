"""Benchmark: the TensorRT-LLM targets' checkpoint step (ModelOpt calibration + TensorRT-LLM
checkpoint export), run exactly as `pipeline build` runs it: the target's own request
(`TrtllmTarget.checkpoint_request`), the `modelopt` worker (`run_step`) and the config check
(`check_checkpoint_config`). Prints seconds per phase and what the written config.json says.

    python benchmarks/bench_trtllm_checkpoint.py                          # SmolLM2 (packaged), CPU
    python benchmarks/bench_trtllm_checkpoint.py --model-dir DIR           # an HF checkpoint
    python benchmarks/bench_trtllm_checkpoint.py --random-shape qwen2-7b   # GPU: made on the spot

`--random-shape qwen2-7b` builds a random-weight model with Qwen2-7B-Instruct's shapes (no model
can be downloaded on the GPU machine) and SmolLM2's tokenizer (`--tokenizer-dir`). The model step
uses the environment's own python when PIPELINE_MODELOPT_PYTHON is unset and .envs/modelopt is
missing (e.g. on a GPU machine with ModelOpt installed beside torch).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.constants import ENV_MODELOPT, KNOWN_HUB_CONFIGS
from pipeline.environments import environment_exists, run_step
from pipeline.project import Project
from pipeline.recipe import load_recipe
from pipeline.targets.trtllm import TrtllmTarget, check_checkpoint_config

REPO = Path(__file__).resolve().parent.parent


# random-weight checkpoint shapes: KNOWN_HUB_CONFIGS's model, its positions and RoPE base
SHAPES: dict[str, tuple[str, int, float]] = {
    "qwen2-7b": ("Qwen/Qwen2-7B-Instruct", 32768, 1000000.0),
    "qwen2.5-32b": ("Qwen/Qwen2.5-32B-Instruct", 32768, 1000000.0),
    "llama2-70b": ("meta-llama/Llama-2-70b-hf", 4096, 10000.0),
}


def shape_config(shape: str = "qwen2-7b", arch: str = "qwen2", **overrides: object) -> object:
    """A transformers config with a known model's shapes (SHAPES, KNOWN_HUB_CONFIGS), declared as
    `arch` (qwen2, or llama for llama.cpp's converter), for random-weight checkpoints."""
    from transformers import AutoConfig

    repo, positions, rope_theta = SHAPES[shape]
    c = KNOWN_HUB_CONFIGS[repo]
    return AutoConfig.for_model(
        arch,
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"],
        num_hidden_layers=c["num_hidden_layers"],
        vocab_size=c["vocab_size"],
        tie_word_embeddings=bool(c["tie_word_embeddings"]),
        max_position_embeddings=positions,
        rope_theta=rope_theta,
        **overrides,
    )


def random_model(shape: str, tokenizer_dir: Path, out: Path) -> float:
    """A random-weight checkpoint with a known model's shapes, written as safetensors."""
    import torch
    from transformers import Qwen2ForCausalLM

    assert shape == "qwen2-7b"
    config = shape_config(torch_dtype="bfloat16")
    t0 = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    for p in model.parameters():  # small weights keep activations finite through 28 layers
        p.data.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    for f in tokenizer_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    del model
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--random-shape", choices=["qwen2-7b"])
    ap.add_argument("--tokenizer-dir", type=Path)
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "qwen2-7b.yaml")
    ap.add_argument("--targets", default="trtllm-fp8,trtllm-int8")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--out", type=Path, default=Path(tempfile.mkdtemp(prefix="bench-trtllm-")))
    args = ap.parse_args()
    if not environment_exists(ENV_MODELOPT):
        os.environ["PIPELINE_MODELOPT_PYTHON"] = sys.executable
    work = args.out
    work.mkdir(parents=True, exist_ok=True)
    model_dir = args.model_dir
    if model_dir is None and not args.random_shape:
        from pipeline.source import resolve_source

        smollm2 = load_recipe(REPO / "recipes" / "smollm2-135m.yaml")
        model_dir = resolve_source(smollm2, work / "source.log").path
    if args.random_shape:
        model_dir = work / f"random-{args.random_shape}"
        seconds = random_model(args.random_shape, args.tokenizer_dir, model_dir)
        print(f"made random {args.random_shape} in {model_dir}: {seconds:.1f} s")
    # Calibration text long enough for samples x seq_len (content is irrelevant to timing).
    text = (REPO / "pipeline" / "data" / "gpl-3.0.txt").read_text()
    calib = work / "calibration.txt"
    calib.write_text("\n\n".join([text] * max(1, args.samples * args.seq_len // 6000 + 1)))
    data = yaml.safe_load(args.recipe.read_text())
    names = args.targets.split(",")
    data["source"] = {"path": str(model_dir)}
    data["calibration"] = {"dataset": str(calib), "samples": args.samples, "seq_len": args.seq_len, "seed": 0}
    data["targets"] = {n: data["targets"][n] for n in names}
    for spec in data["targets"].values():
        spec.pop("calibration", None)
    recipe = work / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data))
    project = Project.open(recipe, root=work / "artifacts")
    ctx = project.context()
    loaded = project.loaded
    report = {}
    for name in names:
        spec = loaded.recipe.targets[name]
        assert isinstance(spec, TrtllmTarget)
        out = work / f"checkpoint-{name}"
        shutil.rmtree(out, ignore_errors=True)
        request = spec.checkpoint_request(ctx, out)
        t0 = time.perf_counter()
        result = run_step(ENV_MODELOPT, request, work / f"{name}.log")
        wall = time.perf_counter() - t0
        problems = check_checkpoint_config(spec, result["config"])
        files = {f.name: f.stat().st_size for f in sorted(out.iterdir())}
        cal = result["calibration"]
        report[name] = {
            "wall_s": round(wall, 1),
            "calibrate_s": round(cal["seconds"], 1),
            "export_s": round(result["export_seconds"], 1),
            "load_and_start_s": round(wall - cal["seconds"] - result["export_seconds"], 1),
            "calibration_tokens": cal["tokens"],
            "device": result["device"],
            "quantization": result["config"].get("quantization"),
            "mapping": result["config"].get("mapping"),
            "dtype": result["config"].get("dtype"),
            "architecture": result["config"].get("architecture"),
            "matches_recipe": not problems,
            "problems": problems,
            "files_bytes": files,
            "toolchain": result["toolchain"],
        }
        r = report[name]
        q = r["quantization"]
        print(
            f"{name}: wall {r['wall_s']} s = load/start {r['load_and_start_s']} "
            f"+ calibrate {r['calibrate_s']} ({r['calibration_tokens']} tokens) "
            f"+ export {r['export_s']} on {r['device']}; quant_algo {q.get('quant_algo')}, "
            f"kv {q.get('kv_cache_quant_algo')}, dtype {r['dtype']}, tp {r['mapping']['tp_size']}; "
            f"matches recipe: {r['matches_recipe']} {problems}"
        )
        shutil.rmtree(out, ignore_errors=True)
    (work / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
