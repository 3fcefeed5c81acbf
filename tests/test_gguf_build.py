"""Real GGUF builds of a tiny random-weight Llama: llama.cpp converts, quantizes and validates.

Nothing here is mocked: the failure cases use a real crashing process, a real unsupported
architecture and a real full filesystem (tmpfs).
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pipeline.cli import app
from pipeline.constants import MANIFEST_NAME, STAGING_PREFIX
from pipeline.errors import DiskFullError, RegistryError, ValidationFailed
from pipeline.hashing import file_sha256
from pipeline.project import Project
from pipeline.registry import Registry
from tests.conftest import llama_servers, read_json, serve_and_ask, write_recipe

pytestmark = pytest.mark.slow

LOOSE = {"max_ppl_delta_pct": 100.0, "max_kld_mean": 10.0}  # random weights: gates are not the point
TARGETS = {
    "gguf-f16": {"kind": "gguf", "quant": "F16", "gates": {"max_ppl_delta_pct": 0.1, "max_kld_mean": 0.001}},
    "gguf-q4_0": {"kind": "gguf", "quant": "Q4_0", "imatrix": True, "gates": LOOSE},
}
FIXED_FIELDS = {
    "schema",
    "recipe",
    "recipe_sha256",
    "target",
    "kind",
    "engine",
    "format",
    "quant",
    "source",
    "files",
    "toolchain",
    "build",
    "validation",
    "serve",
}


def build_recipe(recipe: Path, names: list[str] | None = None, **kwargs: object) -> list:
    return Project.open(recipe).build(names, **kwargs)  # type: ignore[arg-type]


def _no_staging(root: Path) -> bool:
    return not any(p.name.startswith(STAGING_PREFIX) for p in root.rglob("*"))


def test_build_validate_publish_and_rebuild(tiny_recipe_dir: Path, _isolated_artifacts: Path) -> None:
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets=TARGETS)
    results = {r.target: r for r in build_recipe(recipe, threads=2)}
    assert {r.outcome for r in results.values()} == {"built"}, results
    assert results["gguf-f16"].validation == "passed", results["gguf-f16"].message
    assert abs(results["gguf-f16"].metrics["ppl_delta_pct"]) < 0.1

    root = _isolated_artifacts / "tiny"
    f16 = read_json(root / "gguf-f16" / MANIFEST_NAME)
    assert f16.keys() >= FIXED_FIELDS
    assert f16["engine"] == "llama.cpp" and f16["format"] == "gguf" and f16["quant"] == "F16"
    assert set(f16["toolchain"]) == {"llamacpp"}  # the one environment that wrote and scored it
    assert f16["toolchain"]["llamacpp"]["llama.cpp"] and f16["toolchain"]["llamacpp"]["llama-cpp-python"]
    assert f16["source"]["path"] and len(f16["source"]["sha256"]) == 64
    metrics = f16["validation"]["metrics"]
    for key in ("ppl", "ppl_ref", "ppl_delta_pct", "kld_mean", "token_agreement", "tokens_per_s"):
        assert metrics[key] is not None, key
    assert metrics["token_agreement"] == 1.0 and metrics["tokenizer_prefix_match"] == 1.0
    (entry,) = f16["files"]
    assert entry["sha256"] == file_sha256(root / "gguf-f16" / entry["path"])

    verdict = f16["validation"]["engines"]["llama.cpp"]
    assert verdict["status"] == "passed" and verdict["engine_version"] == entry_version(f16)
    assert verdict["generations"] and verdict["generations"][0]["agreement"] == 1.0

    placement = verdict["details"]["placement"]  # this CPU build: no offload, the threads asked for
    assert placement == {"gpu_offload": False, "n_gpu_layers": 0, "threads": 2}
    assert f16["validation"]["reference"]["dtype"] == "float32"  # a tiny model fits: the exact one
    ops = [(s["env"], s["op"]) for s in f16["build"]["steps"]]
    assert ("llamacpp", "convert") in ops and ops[-4:] == [
        ("llamacpp", "validate"),
        ("llamacpp", "kld_base"),
        ("llamacpp", "kld"),
        ("llamacpp", "serve_check"),
    ], ops
    # the deploy command, llama-server, answered the first smoke prompt as llama-cpp-python did
    served = verdict["details"]["serve_check"]
    assert (
        served["ok"]
        and served["compared"] == "token_ids"
        and served["modes"]
        == ("flash-attention-off offline vs flash-attention-off server (the deploy command + -fa off)")
    )
    assert served["token_ids"] == verdict["generations"][0]["output_ids"] and served["ready_s"] > 0
    # a step shorter than the RSS sampler's period may be sampled only as it starts (kld: 0.3 s)
    assert all(s["seconds"] > 0 and s["peak_rss_mib"] > 0 for s in f16["build"]["steps"])
    assert all(s["peak_rss_mib"] > 10 for s in f16["build"]["steps"] if s["seconds"] > 2)
    # llama-perplexity against the F16 GGUF: the F16 artifact is that file
    by_llama = verdict["details"]["llama_perplexity"]
    assert by_llama["tool"] == "llama-perplexity" and by_llama["kld_mean"] == pytest.approx(0, abs=1e-4)
    assert by_llama["chunks"] == 2 and by_llama["tokens_scored"] == 2 * 63  # tokens 256, ctx 128
    # the project's numbers are on llama-perplexity's conventions (same windows, the second half of
    # each scored, BOS as the tokenizer has it): the same positions, and the same perplexity from
    # llama.cpp through either path
    reference = f16["validation"]["reference"]
    assert reference["ctx"] == 128 and reference["scored_from"] == 64
    assert reference["bos_token_id"] is None  # SmolLM2's tokenizer declares BOS and does not add it
    assert metrics["scored_tokens"] == by_llama["tokens_scored"]
    assert metrics["ppl"] == pytest.approx(by_llama["ppl"], rel=1e-3)
    assert metrics["ppl_ref"] == pytest.approx(by_llama["ppl_base"], rel=1e-2)  # transformers fp32 vs F16
    # the F16 run's own PPL (the reference check's number) and the one its KL base file gives agree
    # on a trained model: the file's 16-nat floor binds only on a near-random one (the H100's 7B shape)
    assert by_llama["ppl_base_run"] == pytest.approx(by_llama["ppl_base"], rel=1e-3)

    q4 = read_json(root / "gguf-q4_0" / MANIFEST_NAME)
    assert set(q4["toolchain"]) == {"llamacpp"}  # imatrix: llama-imatrix, in the llama.cpp environment
    assert q4["gguf"]["tensor_types"].get("Q4_0", 0) > 0
    imatrix = q4["gguf"]["imatrix"]
    assert imatrix["tool"] == "llama-imatrix" and imatrix["chunks"] == 4
    assert imatrix["tensors"] > 0 and imatrix["dataset"] == "builtin:gpl-3.0"
    q4_llama = q4["validation"]["engines"]["llama.cpp"]["details"]["llama_perplexity"]
    assert q4_llama["kld_mean"] > by_llama["kld_mean"] and q4_llama["ppl_base"] == by_llama["ppl_base"]
    assert _no_staging(_isolated_artifacts)

    again = build_recipe(recipe, threads=2)
    assert {r.outcome for r in again} == {"up-to-date"}

    # One byte written in place into the workspace's 0444 file (root can): the kept version shares
    # no storage with it, and the next build finds the damage instead of calling it up to date.
    model, kept = root / "gguf-f16" / entry["path"], root / ".versions" / "gguf-f16" / "1" / entry["path"]
    model.chmod(0o644)
    with open(model, "r+b") as fh:
        fh.seek(model.stat().st_size // 2)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0xFF]))
    assert file_sha256(kept) == entry["sha256"] != file_sha256(model)
    [rebuilt] = build_recipe(recipe, ["gguf-f16"], threads=2)
    assert rebuilt.outcome == "built" and rebuilt.validation == "passed", rebuilt.message
    assert f"rebuilt: the workspace copy was damaged ({entry['path']}: checksum mismatch)" in rebuilt.message
    assert file_sha256(model) == entry["sha256"]  # the same bytes again (a deterministic build)

    registry = Registry(_isolated_artifacts)
    hit = registry.resolve("tiny", "llama.cpp", "F16", engine_version=entry_version(f16))
    assert Path(hit["path"]) == (root / "gguf-f16").resolve() and hit["files"] == f16["files"]
    assert registry.verify("tiny/gguf-f16") == []
    listed = CliRunner().invoke(app, ["list", "--json"])
    assert listed.exit_code == 0
    assert {a["target"] for a in json.loads(listed.output)} == {"gguf-f16", "gguf-q4_0"}
    shown = CliRunner().invoke(app, ["show", "tiny/gguf-f16", "--json"])
    assert json.loads(shown.output)["files"] == f16["files"]
    answer = serve_and_ask(hit["serve"]["command"], hit["path"])
    assert answer["object"] == "text_completion" and answer["choices"][0]["finish_reason"] in (
        "length",
        "stop",
    )


def entry_version(manifest: dict) -> str:
    return manifest["toolchain"]["llamacpp"]["llama-cpp-python"]


def _on_validate(tmp_path: Path, name: str, shell: str) -> str:
    """An interpreter that runs `shell` first when a step asks it to validate (the request file is
    $3 of `python -m MODULE REQUEST RESULT`), then the real interpreter."""
    script = tmp_path / name
    script.write_text(
        f'#!/bin/sh\ngrep -q \'"op": "validate"\' "$3" && {shell}\nexec {sys.executable} "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


def _crash_on_validate(tmp_path: Path) -> str:
    """An interpreter that runs the real one but segfaults when asked to validate."""
    return _on_validate(tmp_path, "crashy-python", "kill -SEGV $$")


def test_engine_crash_keeps_the_built_artifact(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-f16": TARGETS["gguf-f16"]})
    (first,) = build_recipe(recipe, threads=2)
    assert first.validation == "passed"
    artifact = _isolated_artifacts / "tiny" / "gguf-f16"
    before = {p.name: p.read_bytes() for p in artifact.iterdir()}

    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _crash_on_validate(tmp_path))
    (second,) = build_recipe(recipe, force=True, threads=2)
    assert second.outcome == "error"
    assert "engine process crashed (SIGSEGV)" in second.message and "\n" not in second.message
    assert {p.name: p.read_bytes() for p in artifact.iterdir()} == before
    assert _no_staging(_isolated_artifacts)

    res = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "build", str(recipe), "--force"],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 5, res.stdout + res.stderr
    assert "crashed (SIGSEGV)" in res.stderr


def test_unsupported_architecture(tiny_llama: Path, tmp_path: Path, _isolated_artifacts: Path) -> None:
    model = tmp_path / "recipes" / "model"
    shutil.copytree(tiny_llama, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchModelForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path / "recipes" / "tiny.yaml")
    (result,) = build_recipe(recipe)
    assert result.outcome == "error"
    assert "NoSuchModelForCausalLM is not supported" in result.message
    assert not (_isolated_artifacts / "tiny" / "gguf-f16").exists()
    assert _no_staging(_isolated_artifacts)


def test_full_disk_is_one_clear_error(
    tiny_recipe_dir: Path, small_tmpfs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """24 MiB holds the F16 GGUF but not the reference logits: the build stops, nothing is published."""
    monkeypatch.setenv("PIPELINE_ARTIFACTS", str(small_tmpfs))
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml")
    with pytest.raises(DiskFullError, match="no space left on device"):
        build_recipe(recipe)
    assert not (small_tmpfs / "tiny" / "gguf-f16").exists()
    assert _no_staging(small_tmpfs)


def test_a_second_build_of_the_same_target_is_refused(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """While one process builds a target, another build of it fails at once, naming the holder."""
    import multiprocessing

    from pipeline.artifacts import Layout, build_lock

    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-f16": TARGETS["gguf-f16"]})
    ready, release = multiprocessing.Event(), multiprocessing.Event()

    def hold() -> None:
        with build_lock(Layout(_isolated_artifacts, "tiny"), "gguf-f16"):
            ready.set()
            release.wait(60)

    holder = multiprocessing.get_context("fork").Process(target=hold)
    holder.start()
    try:
        assert ready.wait(30)
        [result] = build_recipe(recipe, threads=2)
        assert result.outcome == "error"
        assert f"tiny/gguf-f16 is being built by another process (pid {holder.pid})" in (result.message or "")
        assert not (_isolated_artifacts / "tiny" / "gguf-f16").exists()
    finally:
        release.set()
        holder.join(30)
    [again] = build_recipe(recipe, threads=2)
    assert again.outcome == "built"


Q4 = {"kind": "gguf", "quant": "Q4_0", "gates": LOOSE}


def test_a_gate_below_the_measured_value_fails_and_never_displaces_the_passing_version(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """The same artifact, measured once with loose gates, then rebuilt gated just below what was
    measured: `failed`, exit 7, kept as version 2 with its reason; the workspace and `resolve`
    still give version 1, which passed, and version 2 cannot be promoted."""
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-q4_0": Q4})
    [loose] = build_recipe(recipe, threads=2)
    assert loose.validation == "passed"
    measured = loose.metrics["kld_mean"]
    assert measured > 0
    tight = {**Q4, "gates": {**LOOSE, "max_kld_mean": measured * 0.9}}
    write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-q4_0": tight})
    res = CliRunner().invoke(app, ["build", str(recipe), "--threads", "2"])
    assert res.exit_code == ValidationFailed.exit_code, res.output
    assert "validation failed for gguf-q4_0" in res.output and "kept as version 2" in res.output
    root = _isolated_artifacts / "tiny"
    failed = read_json(root / ".versions" / "gguf-q4_0" / "2" / MANIFEST_NAME)
    v = failed["validation"]
    assert v["status"] == "failed" and v["engines"]["llama.cpp"]["status"] == "failed"
    assert v["reason"] == f"kld_mean {measured:.5f} > {measured * 0.9}"
    assert v["metrics"]["kld_mean"] == pytest.approx(measured)  # same bytes, same number
    assert read_json(root / "gguf-q4_0" / MANIFEST_NAME)["validation"]["status"] == "passed"

    registry = Registry(_isolated_artifacts)
    hit = registry.resolve("tiny", "llama.cpp", "Q4_0")
    assert (hit["version"], hit["location"], hit["status"]) == (1, "workspace", "passed")
    assert registry.verify("tiny/gguf-q4_0") == []
    first, second = registry.history("tiny/gguf-q4_0")
    assert (first.current, second.current, second.status) == (True, False, "failed")
    with pytest.raises(RegistryError, match="version 2 did not pass validation"):
        registry.promote("tiny/gguf-q4_0", "prod", version=2)
    assert registry.promote("tiny/gguf-q4_0", "prod")["version"] == 1


def _damage_before_validate(tmp_path: Path) -> str:
    """An interpreter that, asked to validate a GGUF, first overwrites one weight tensor of it with
    noise (on its own copy of the file), then runs the real validation."""
    damage = (
        "import json, os, shutil, sys; import numpy as np; import gguf\n"
        "path = json.load(open(sys.argv[1]))['gguf_path']\n"
        "shutil.copyfile(path, path + '.copy'); os.replace(path + '.copy', path)  # not the cached base\n"
        "reader = gguf.GGUFReader(path, 'r+')\n"
        "t = next(t for t in reader.tensors if t.name == 'blk.0.ffn_down.weight')\n"
        "t.data[...] = np.random.default_rng(0).normal(0, 1, t.data.shape).astype(t.data.dtype)\n"
        "reader.data.flush()\n"
    )
    (tmp_path / "damage.py").write_text(damage)
    return _on_validate(tmp_path, "damaging-python", f'{sys.executable} {tmp_path / "damage.py"} "$3"')


def test_damaged_weights_fail_their_gates(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-f16": TARGETS["gguf-f16"]})
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", _damage_before_validate(tmp_path))
    [result] = build_recipe(recipe, threads=2)
    assert result.outcome == "built" and result.validation == "failed", result.message
    assert "ΔPPL" in (result.message or "") and "kld_mean" in (result.message or "")
    assert result.metrics["kld_mean"] > 0.001


def test_a_deploy_command_that_cannot_serve_fails_the_verdict_and_never_resolves(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GGUF scores as it should, but the llama-server its serve command starts exits before it
    is ready (a stand-in that says why): the verdict is `failed` with the server's own words, the
    artifact is kept and recorded, and it does not resolve."""
    from pipeline.workers.llamacpp import llama_cpp_dir

    tools = tmp_path / "llama.cpp"
    tools.mkdir()
    for entry in llama_cpp_dir().iterdir():  # the real converter, gguf-py and tools...
        if entry.name != "bin":
            (tools / entry.name).symlink_to(entry)
    (tools / "bin").mkdir()
    for tool in (llama_cpp_dir() / "bin").iterdir():
        (tools / "bin" / tool.name).symlink_to(tool)
    server = tools / "bin" / "llama-server"
    server.unlink()  # ...but a server that cannot start
    server.write_text('#!/bin/sh\necho "error: failed to allocate the KV cache" >&2; exit 3\n')
    server.chmod(0o755)
    monkeypatch.setenv("PIPELINE_LLAMA_CPP_DIR", str(tools))
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-f16": TARGETS["gguf-f16"]})
    [result] = build_recipe(recipe, threads=2)
    assert result.outcome == "built" and result.validation == "failed", result
    verdict = read_json(_isolated_artifacts / "tiny" / "gguf-f16" / MANIFEST_NAME)["validation"]
    assert verdict["metrics"]["ppl_delta_pct"] < 0.1  # the file itself scored as it should
    served = verdict["engines"]["llama.cpp"]["details"]["serve_check"]
    assert not served["ok"] and served["command"].startswith("llama-server -m ${ARTIFACT_DIR}/model.gguf")
    assert re.search(
        r"the serve check's server did not answer: .*exited with code 3 before it was ready: "
        r"error: failed to allocate the KV cache",
        verdict["reason"],
    ), verdict["reason"]
    with pytest.raises(RegistryError):
        Registry(_isolated_artifacts).resolve("tiny", "llama.cpp", "F16")


def test_an_eos_token_that_differs_from_the_reference_fails(
    tiny_llama: Path, tmp_path: Path, _isolated_artifacts: Path
) -> None:
    """The reference stops at the end-of-turn token its generation config names; a GGUF whose eos
    is another token would run on past it in llama.cpp."""
    model = tmp_path / "recipes" / "model"
    shutil.copytree(tiny_llama, model)
    generation = json.loads((model / "generation_config.json").read_text())
    generation["eos_token_id"] = 5
    (model / "generation_config.json").write_text(json.dumps(generation))
    recipe = write_recipe(tmp_path / "recipes" / "tiny.yaml")
    [result] = build_recipe(recipe, threads=2)
    assert result.validation == "failed"
    assert result.message == "GGUF eos token 2 is not the reference's [5]"


def _shadow_version(tmp_path: Path, dist: str, version: str) -> Path:
    """A site dir whose dist-info says `dist` is `version` (what the toolchain probes read)."""
    info = tmp_path / "shadow" / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    return info.parent


def test_a_changed_environment_makes_the_target_stale(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-f16": TARGETS["gguf-f16"]})
    [first] = build_recipe(recipe, threads=2)
    [same] = build_recipe(recipe, threads=2)
    assert (first.outcome, same.outcome) == ("built", "up-to-date")
    # an artifact validated against a bfloat16 reference (a busy host's), the reference float32 now
    path = _isolated_artifacts / "tiny" / "gguf-f16" / MANIFEST_NAME
    manifest = read_json(path)
    manifest["validation"]["reference"]["dtype"] = "bfloat16"
    path.chmod(0o644)
    path.write_text(json.dumps(manifest))
    [revalidated] = build_recipe(recipe, threads=2)
    assert revalidated.outcome == "built"
    assert "rebuilt: validated against a bfloat16 reference, which is float32 now" in revalidated.message
    assert "files kept from the build of" in revalidated.message  # the reference decides the numbers only
    assert read_json(path)["validation"]["reference"]["dtype"] == "float32"
    monkeypatch.setenv("PYTHONPATH", str(_shadow_version(tmp_path, "gguf", "99.0")))
    [after] = build_recipe(recipe, threads=2)
    assert after.outcome == "built"
    manifest = read_json(_isolated_artifacts / "tiny" / "gguf-f16" / MANIFEST_NAME)
    assert manifest["toolchain"]["llamacpp"]["gguf"] == "99.0"
    assert "files kept" not in (after.message or "")  # the converter's version decides the bytes


def _venv_with_stamp(tmp_path: Path, stamp: str) -> Path:
    """A venv that sees this interpreter's packages (a .pth) and says it was installed from `stamp`
    (what scripts/setup.sh writes): the same bytes of every library, another lock."""
    import site
    import sysconfig

    venv = tmp_path / "relocked"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(venv), "platbase": str(venv)}))
    (purelib / "parent.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    (venv / ".pipeline-lock").write_text(stamp + "\n")
    (venv / "share").symlink_to(Path(sys.prefix) / "share")  # the converter set-up placed there
    return venv / "bin" / "python"


def test_a_changed_lock_makes_the_target_stale_and_is_recorded(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets={"gguf-f16": TARGETS["gguf-f16"]})
    [first] = build_recipe(recipe, threads=2)
    assert first.outcome == "built"
    installed = read_json(_isolated_artifacts / "tiny" / "gguf-f16" / MANIFEST_NAME)["toolchain"]
    # set-up installed .venv from the committed lock: the record names it with that file's sha256
    core_lock = Path(__file__).resolve().parent.parent / "envs" / "core.lock"
    assert f"envs/core.lock sha256:{file_sha256(core_lock)}" in installed["llamacpp"]["lock"]
    monkeypatch.setenv("PIPELINE_LLAMACPP_PYTHON", str(_venv_with_stamp(tmp_path, "envs/core.lock sha256:0")))
    [after] = build_recipe(recipe, threads=2)
    assert after.outcome == "built", after
    toolchain = read_json(_isolated_artifacts / "tiny" / "gguf-f16" / MANIFEST_NAME)["toolchain"]
    assert toolchain["llamacpp"]["lock"] == "envs/core.lock sha256:0"
    assert {k: v for k, v in toolchain["llamacpp"].items() if k != "lock"} == {
        k: v for k, v in installed["llamacpp"].items() if k != "lock"
    }


BENCH = {"enabled": True, "prompt_tokens": 16, "output_tokens": 8, "concurrency": [1, 2], "requests": 2,
         "min_waves": 2}  # fmt: skip


def test_a_failing_benchmark_is_recorded_and_never_touches_the_artifact(
    tiny_recipe_dir: Path, _isolated_artifacts: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The happy path runs in the end-to-end test on SmolLM2's artifacts. Here each way the
    benchmark can fail: a server that never gets ready (inside a build: the artifact is still
    published and resolves), then on that artifact a port taken by another process and a tokenizer
    that cannot load (the load generator's, refused before it starts a server; GuideLLM's own exit:
    test_workers.py). Each is `failed` with the reason, and no server is left behind. Last, the
    same artifact benchmarked: GuideLLM ran each level's own request count (whole waves: 2 at
    concurrency 1, 4 at 2)."""
    import pipeline.serving
    from pipeline.manifest import read_manifest
    from pipeline.serving import benchmark

    recipe = write_recipe(
        tiny_recipe_dir / "tiny.yaml", targets={"gguf-f16": TARGETS["gguf-f16"]}, serving_benchmark=BENCH
    )
    with monkeypatch.context() as patched:
        patched.setattr(pipeline.serving, "READY_TIMEOUT_S", 0.5)
        [result] = build_recipe(recipe, threads=2)
    assert result.outcome == "built" and result.validation == "passed", result
    artifact = _isolated_artifacts / "tiny" / "gguf-f16"
    serving = read_json(artifact / MANIFEST_NAME)["serving"]["llama.cpp"]
    assert serving["status"] == "failed" and serving["levels"] == {}
    assert re.search(r"the server was not ready within [01] s", serving["reason"]), serving["reason"]
    assert Registry(_isolated_artifacts).resolve("tiny", "llama.cpp", "F16")["status"] == "passed"
    assert llama_servers(_isolated_artifacts) == []

    project = Project.open(recipe)
    ctx, manifest = project.context(), read_manifest(artifact)
    command = project.select(["gguf-f16"])["gguf-f16"].serve_argv  # the deploy command's builder
    with socket.socket() as taken:  # another process holds the port the server is given
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        got = benchmark(ctx, "gguf-f16", artifact, manifest.validation, command, port=taken.getsockname()[1])
    assert got["llama.cpp"].status == "failed"
    reason = got["llama.cpp"].reason
    assert re.search(r"exited with code [1-9]\d* before it was ready: .*couldn't bind HTTP server", reason)

    server_log = _isolated_artifacts / "tiny" / ".logs" / "gguf-f16-llamacpp-bench-server.log"
    before = server_log.read_bytes()  # the port-taken run's
    copy = tmp_path / "broken-tokenizer"
    shutil.copytree(artifact, copy)
    (copy / "tokenizer.json").write_text("{not json")
    got = benchmark(ctx, "gguf-f16", copy, manifest.validation, command)
    assert got["llama.cpp"].status == "failed"
    assert re.search(r"the tokenizer at .*broken-tokenizer did not load", got["llama.cpp"].reason)
    assert server_log.read_bytes() == before  # no server started
    assert llama_servers(_isolated_artifacts) == [] and llama_servers(tmp_path) == []
    assert read_manifest(artifact) == manifest

    got = benchmark(ctx, "gguf-f16", artifact, manifest.validation, command)["llama.cpp"]
    assert got.status == "passed", got.reason
    assert [(lv.planned, lv.completed + lv.errored, lv.incomplete) for lv in got.levels.values()] == [
        (2, 2, 0), (4, 4, 0)
    ]  # fmt: skip
    assert llama_servers(_isolated_artifacts) == []


def test_a_rebuild_that_moves_only_the_numbers_inputs_keeps_the_files_and_scores_them_again(
    tiny_recipe_dir: Path, _isolated_artifacts: Path
) -> None:
    """A changed deploy command (or benchmark, or gate) decides the numbers, not the bytes: the
    rebuild copies the verified files instead of converting and quantizing again, validates and
    serve-checks them under the new command, and names the build that made them. On 2026-12-06 a
    changed benchmark cap requantized a 7B GGUF on the device, and the disk ran out. A changed
    quantization builds anew."""
    q4 = {"gguf-q4_0": TARGETS["gguf-q4_0"]}
    calibration_text = tiny_recipe_dir / "calibration.txt"  # a local text: its contents decide the imatrix
    shutil.copyfile(
        Path(__file__).resolve().parent.parent / "pipeline" / "data" / "gpl-3.0.txt", calibration_text
    )
    calibration = {"dataset": "calibration.txt", "samples": 4, "seq_len": 64}
    recipe = write_recipe(tiny_recipe_dir / "tiny.yaml", targets=q4, calibration=calibration)
    [first] = build_recipe(recipe, threads=2)

    def rewrite(targets: dict, parallel: int) -> None:  # the same recipe, other targets or slots
        serve = {"llamacpp": {"parallel": parallel}}
        write_recipe(recipe, targets=targets, calibration=calibration, serve=serve)

    assert first.outcome == "built" and first.validation == "passed", first.message
    root = _isolated_artifacts / "tiny" / "gguf-q4_0"
    before = read_json(root / MANIFEST_NAME)
    assert before["build"]["bytes_sha256"] and before["build"]["bytes_from"] is None

    rewrite(q4, parallel=2)
    [again] = build_recipe(recipe, threads=2)
    assert again.outcome == "built" and again.validation == "passed", again.message
    assert f"files kept from the build of {before['build']['finished_at']}" in again.message
    after = read_json(root / MANIFEST_NAME)
    assert after["files"] == before["files"] and after["quant"] == "Q4_0"
    assert after["gguf"] == before["gguf"]  # the tensor types and imatrix record of the build that made it
    assert after["build"]["bytes_sha256"] == before["build"]["bytes_sha256"]
    assert after["build"]["inputs_sha256"] != before["build"]["inputs_sha256"]
    assert after["build"]["bytes_from"]["inputs_sha256"] == before["build"]["inputs_sha256"]
    ops = [s["op"] for s in after["build"]["steps"]]
    assert not {"convert", "imatrix", "quantize"} & set(ops) and "validate" in ops, ops
    assert "-np 2" in after["serve"]["command"] and "-np 2" not in before["serve"]["command"]
    assert after["validation"]["engines"]["llama.cpp"]["details"]["serve_check"]["ok"]

    # kept twice: still the build that made them
    rewrite(q4, parallel=4)
    [third] = build_recipe(recipe, threads=2)
    assert f"files kept from the build of {before['build']['finished_at']}" in third.message
    assert read_json(root / MANIFEST_NAME)["build"]["bytes_from"] == after["build"]["bytes_from"]

    # the calibration text edited in place, the recipe untouched: out of date, built anew (before
    # 2026-12-06 the target read as up to date)
    calibration_text.write_text(calibration_text.read_text()[::-1])
    [recalibrated] = build_recipe(recipe, threads=2)
    assert recalibrated.outcome == "built" and "files kept" not in (recalibrated.message or "")
    assert {"imatrix", "quantize"} <= {s["op"] for s in read_json(root / MANIFEST_NAME)["build"]["steps"]}

    other = {"gguf-q4_0": {**TARGETS["gguf-q4_0"], "quant": "Q8_0"}}
    rewrite(other, parallel=2)
    [rebuilt] = build_recipe(recipe, threads=2)
    assert rebuilt.outcome == "built" and "files kept" not in (rebuilt.message or "")
    assert "quantize" in [s["op"] for s in read_json(root / MANIFEST_NAME)["build"]["steps"]]
