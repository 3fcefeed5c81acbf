"""Shared fixtures: tiny random-weight Llama checkpoints (real files), recipe writers, artifact
directories with typed manifests, and the `gpu` marker (those tests run only where a GPU is)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def _has_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


# The longest test files, longest first (fresh-clone durations, benchmarks/results/): with
# `make test`'s two workers taking one file at a time, the end-to-end build starts at once.
LONGEST_FIRST = (
    "test_smollm2_e2e.py",
    "test_int4.py",
    "test_gemma3.py",
    "test_gguf_build.py",
    "test_cluster.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """On a host with several GPUs, `PIPELINE_TEST_GPU_PER_WORKER=1 pytest -m gpu -n N --dist load`
    gives xdist worker gwK GPU K alone: its engines, quantizers and engine lock (one per
    CUDA_VISIBLE_DEVICES) never meet another worker's."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and os.environ.get("PIPELINE_TEST_GPU_PER_WORKER") == "1":
        os.environ["CUDA_VISIBLE_DEVICES"] = worker.removeprefix("gw")
    # `make test`'s workers share the host's cores, so each worker's tools get their share: torch's
    # OpenMP reads OMP_NUM_THREADS, and so does pipeline/workers/llamacpp.py for llama.cpp's threads.
    # Two workers on 2 cores with two threads each spin against each other: llm-compressor's AWQ
    # took 307 s instead of ~30 (2026-12-06: small matmuls in two such processes at once ran 6x
    # slower than with one thread each).
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if worker and workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("LLAMA_ARG_THREADS", os.environ["OMP_NUM_THREADS"])  # llama-server's -t


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (a stable sort: each file's own order stays); `gpu` tests need an
    NVIDIA GPU (and each its engine's environment, which it checks itself)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU: run `pytest -m gpu` on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_artifacts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test writes artifacts under its own tmp dir, never into the repo's artifacts/."""
    root = tmp_path / "artifacts"
    monkeypatch.setenv("PIPELINE_ARTIFACTS", str(root))
    return root


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's real tokenizer files, from the default recipe's source as the pipeline resolves it."""
    from pipeline.recipe import load_recipe
    from pipeline.source import resolve_source

    log = tmp_path_factory.mktemp("logs") / "source.log"
    source = resolve_source(load_recipe(REPO / "recipes" / "smollm2-135m.yaml"), log).path
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    for f in source.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory, smollm2_tokenizer_dir: Path) -> Path:
    """A 2-layer random-weight Llama with SmolLM2's tokenizer: a real safetensors checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(  # head_dim 64: what vLLM's CPU attention supports (16 is refused)
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=49152,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for f in smollm2_tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def empty_checkpoint(directory: Path) -> Path:
    """A source directory a recipe accepts (config.json, no weights): for recipe-only tests."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "config.json"
    if not config.exists():  # a test may have written its own
        config.write_text('{"architectures": ["LlamaForCausalLM"]}')
    return directory


def write_recipe(path: Path, **overrides: object) -> Path:
    """A small valid recipe (tiny model source by default) with top-level overrides."""
    recipe = {
        "name": "tiny",
        "source": {"path": "model"},
        "calibration": {"dataset": "builtin:gpl-3.0", "samples": 4, "seq_len": 64},
        "evaluation": {"text": "builtin:apache-2.0", "tokens": 256, "ctx": 128},
        "smoke": {"prompts": ["Hello there."], "max_new_tokens": 8},
        "targets": {
            "gguf-f16": {
                "kind": "gguf",
                "quant": "F16",
                "gates": {"max_ppl_delta_pct": 0.1, "max_kld_mean": 0.001},
            },
        },
    }
    recipe.update(overrides)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


@pytest.fixture
def tiny_recipe_dir(tmp_path: Path, tiny_llama: Path) -> Path:
    """A recipe directory with `model` linked to the tiny checkpoint."""
    d = tmp_path / "recipes"
    d.mkdir()
    (d / "model").symlink_to(tiny_llama)
    return d


# GPU tests' tiny models take this share of the GPU's memory (vLLM's gpu_memory_utilization, SGLang's
# mem_fraction_static), so that they can run beside a build on the same GPU host.
GPU_TEST_SHARE = 0.15


def require_environments(*names: str) -> None:
    """Skip the calling test, naming each step environment this host lacks (a GPU host may carry
    only some of them)."""
    from pipeline.environments import environment

    missing = [environment(n) for n in names if not environment(n).exists]
    if missing:
        named = (
            f"{e.name!r} environment ({e.interpreter}; PIPELINE_{e.name.upper()}_PYTHON)" for e in missing
        )
        pytest.skip("no " + ", ".join(named))


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def serve_and_ask(command: str, artifact_dir: str) -> dict:
    """What a deploy job does: start the resolved serve command (llama-server from the PATH, here
    the build's own copy), ask once, stop it."""
    import shlex
    import socket
    import time
    import urllib.request

    from pipeline.workers.llamacpp import llama_cpp_dir

    argv = shlex.split(command.replace("${ARTIFACT_DIR}", artifact_dir))
    assert argv[0] == "llama-server" and "-c" in argv and "-np" in argv and "-ngl" in argv
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv[argv.index("--port") + 1] = str(port)
    path = f"{llama_cpp_dir() / 'bin'}{os.pathsep}{os.environ['PATH']}"
    server = subprocess.Popen(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, "PATH": path}
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, "serve command exited"
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "server not ready"
                time.sleep(0.5)
        body = json.dumps({"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())
    finally:
        server.terminate()
        server.wait(30)


def write_artifact(
    root: Path,
    recipe: str,
    target: str,
    engine: str,
    quant: str,
    status: str = "passed",
    gpu_arch: str | None = None,
    toolchain: dict[str, dict[str, str]] | None = None,
    verdicts: dict[str, str] | None = None,
) -> Path:
    """A real artifact directory: a weights file plus a schema-valid manifest with its checksums
    (`verdicts`: engine -> status of each serving engine; default: the primary engine's `status`)."""
    from pipeline.artifacts import file_entries
    from pipeline.constants import MANIFEST_SCHEMA
    from pipeline.manifest import BuildInfo, EngineVerdict, Manifest, ServeInfo, Validation, write_manifest

    d = root / recipe / target
    d.mkdir(parents=True, exist_ok=True)
    weights = d / "model.bin"
    weights.unlink(missing_ok=True)  # new files, as a build's publish makes: never rewritten in place
    weights.write_bytes(f"{recipe}/{target}".encode() * 100)
    engines = {e: EngineVerdict(status=s) for e, s in (verdicts or {engine: status}).items()}
    manifest = Manifest(
        schema=MANIFEST_SCHEMA,
        recipe=recipe,
        recipe_sha256="0" * 64,
        recipe_path=f"recipes/{recipe}.yaml",
        target=target,
        kind=target.split("-")[0],
        engine=engine,
        format="gguf",
        quant=quant,
        source={"path": "model", "sha256": "0" * 64},
        files=file_entries(d),
        toolchain=toolchain or {},
        build=BuildInfo(seconds=1.0, gpu_arch=gpu_arch, inputs_sha256="0" * 64, finished_at="now", spec={}),
        validation=Validation.of(engine, engines, None),
        serve=ServeInfo(command="llama-server -m ${ARTIFACT_DIR}/model.bin"),
    )
    write_manifest(d, manifest)
    return d


# Debian's Chromium, started as the machine's probe showed it works here (no network chatter).
CHROMIUM_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)  # fmt: skip


def chromium() -> str:
    """Path of headless Chromium; a skip where it is missing, a failure where CI requires it
    (.ci/run installs Debian's `chromium` and sets PIPELINE_REQUIRE_BROWSER=1)."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if os.environ.get("PIPELINE_REQUIRE_BROWSER") == "1":
        pytest.fail("Chromium is required here and missing: apt-get install chromium")
    pytest.skip("no Chromium: apt-get install chromium (Debian) to run the browser tests")


def render_in_chromium(page: Path, profile: Path, screenshot: Path | None = None) -> str:
    """The page's DOM after its scripts ran (10 s of virtual time), optionally a PNG of it."""
    argv = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=10000"]
    if screenshot is not None:
        shot = [*argv, f"--screenshot={screenshot}", "--window-size=1400,2200", page.as_uri()]
        subprocess.run(shot, capture_output=True, timeout=120, check=True)
    done = subprocess.run([*argv, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def chart_points(dom: str, chart_id: str) -> list[str]:
    """The aria-labels (Vega's "field: value; ..." text) of the points drawn in one chart's div."""
    start = dom.index(f'id="{chart_id}"')
    end = dom.find('<div class="chart', start)
    marks = re.findall(r"<path\b[^>]*>", dom[start : end if end > 0 else len(dom)])
    return [
        m[1]
        for tag in marks
        if 'aria-roledescription="point"' in tag and (m := re.search(r'aria-label="([^"]*)"', tag))
    ]


def llama_servers(under: Path | None = None) -> list[str]:
    """Command lines of llama.cpp servers (llama-server) still running (serving something under `under`)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0].endswith(b"llama-server") and (
            under is None or any(str(under).encode() in a for a in args)
        ):
            found.append(b" ".join(args).decode(errors="replace"))
    return found


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs (a full disk on demand); skips where mounting needs root."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True
    ).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)
