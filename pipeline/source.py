"""Resolve a recipe's source to a local, safe HF safetensors checkpoint and pin what it is."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from pipeline.artifacts import cache_root, cached_step
from pipeline.constants import (
    ENV_TRANSFORMERS,
    HUB_ALLOW_PATTERNS,
    PACKAGED_SOURCES,
    PICKLE_WEIGHT_SUFFIXES,
    SAFE_WEIGHT_SUFFIXES,
)
from pipeline.environments import check_step_request, run_step
from pipeline.errors import SourceError
from pipeline.hashing import dir_sha256, file_sha256, json_sha256
from pipeline.locks import holding
from pipeline.spec import LoadedRecipe, SourceSpec

MATERIALISER_VERSION = 3  # bump when op_materialise_gguf changes what it writes


@dataclass(frozen=True)
class ResolvedSource:
    """A local checkpoint directory and the manifest's `source` record for it."""

    path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def sha256(self) -> str:
        return self.info["sha256"]


def model_config(path: Path) -> dict[str, Any] | None:
    """A checkpoint's config.json (`path`), the text model's part of a multimodal one; None when it
    is missing or unreadable."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except ValueError:
        return None
    return config.get("text_config", config) if "hidden_size" not in config else config


def resolve_source(loaded: LoadedRecipe, log_path: Path) -> ResolvedSource:
    """Local dir, hub repo at a pinned commit, or a packaged GGUF model, checked and hashed."""
    spec = loaded.recipe.source
    if spec.path:
        path = loaded.resolve_path(spec.path)
        info: dict[str, Any] = {"path": str(path), "revision": None}
    elif spec.repo:
        path = _download(spec)
        info = {"repo": spec.repo, "revision": spec.revision}
    else:
        path, info = _materialise_package(spec.package or "", log_path)
    # a hub snapshot's files are links into the repo's blobs/ (two levels up), nothing else
    check_checkpoint(path, spec.trust_remote_code, links_within=path.parents[1] if spec.repo else path)
    info["sha256"] = dir_sha256(path, cache_root() / "hashes.json")
    return ResolvedSource(path=path, info=info)


def check_checkpoint(path: Path, trust_remote_code: bool = False, links_within: Path | None = None) -> None:
    """Refuse what we must not or cannot load: missing dirs, links leaving `links_within` (default:
    the checkpoint itself), pickle-only weights, truncated safetensors, remote code."""
    if not path.is_dir():
        raise SourceError(f"source checkpoint {path} not found")
    root = (links_within or path).resolve()
    for link in sorted(p for p in path.rglob("*") if p.is_symlink()):
        target = link.resolve()
        if not target.is_relative_to(root):
            raise SourceError(
                f"source file {link} is a link to {target}, outside the checkpoint: copy the file "
                "into the checkpoint directory instead"
            )
    config = path / "config.json"
    if not config.is_file():
        raise SourceError(f"source {path} has no config.json: not a Hugging Face checkpoint")
    names = [p.name for p in path.iterdir()]
    if not any(n.endswith(SAFE_WEIGHT_SUFFIXES) for n in names):
        pickles = sorted(n for n in names if n.endswith(PICKLE_WEIGHT_SUFFIXES))
        if pickles:
            raise SourceError(
                f"source {path} has only pickle weights ({', '.join(pickles[:3])}); pickles can run "
                "code on load. To resolve, convert the checkpoint to safetensors"
            )
        raise SourceError(f"source {path} has no *.safetensors weights")
    for weights in sorted(path.glob("*.safetensors")):
        _check_safetensors_size(weights)
    try:
        cfg = json.loads(config.read_text())
    except ValueError as exc:
        raise SourceError(f"source {config} is not valid JSON: {exc}") from None
    if cfg.get("auto_map") and not trust_remote_code:
        raise SourceError(
            f"source {path} needs custom code (auto_map in config.json); set "
            "source.trust_remote_code: true in the recipe only if you trust it"
        )


def _check_safetensors_size(path: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors' bytes at the
    offsets the header gives: a file shorter than that was cut off (a copy or download that
    stopped). Only the header is read."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 2 or 8 + length > size:
            raise SourceError(f"source file {path}: not a safetensors file or truncated ({size} bytes)")
        try:
            header = json.loads(fh.read(length))
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            raise SourceError(f"source file {path}: its safetensors header is not valid") from None
    promised = 8 + length + end
    if size < promised:
        raise SourceError(f"source file {path} is truncated: {size} bytes, its header promises {promised}")


def _download(spec: SourceSpec) -> Path:
    """snapshot_download at the pinned commit; honours HF_HOME/HF_HUB_CACHE and HF_HUB_OFFLINE."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(
            snapshot_download(repo_id=spec.repo, revision=spec.revision, allow_patterns=HUB_ALLOW_PATTERNS)
        )
    except LocalEntryNotFoundError:
        raise SourceError(
            f"{spec.repo}@{spec.revision[:12]} is not in the local HF cache and the hub cannot be "
            "reached (offline?). To resolve, download it on a connected machine or use source.path"
        ) from None
    except HfHubHTTPError as exc:
        raise SourceError(f"hub download of {spec.repo}@{spec.revision[:12]} failed: {exc}") from None


def _packaged_gguf(name: str) -> tuple[Path, str]:
    """The GGUF file a PACKAGED_SOURCES package ships (joined from its chunk packages, once, by
    the package's own `assemble`, which checks the sha256 it was published with), its version."""
    packaged = PACKAGED_SOURCES[name]
    found = importlib.util.find_spec(packaged.module)
    if found is None or not found.submodule_search_locations:
        raise SourceError(f"package {name} is not installed. To resolve, run scripts/setup.sh")
    try:
        pkg_version = version(name)
    except PackageNotFoundError:
        pkg_version = "unknown"
    if not packaged.assembled:
        return Path(next(iter(found.submodule_search_locations))) / packaged.gguf, pkg_version
    out = cache_root() / "packages" / f"{name}-{pkg_version}" / packaged.gguf  # `holding` makes its dir
    try:  # a data-only, stdlib-only package: importing it runs nothing but its own assemble
        assemble = importlib.import_module(packaged.module).assemble
        with holding(out.with_name(f".{out.name}.lock"), f"assembling {name}", lambda _who: None):
            return Path(assemble(out)), pkg_version
    except (OSError, ValueError) as exc:  # a missing chunk, a wrong sha256, a full disk
        raise SourceError(f"package {name}: cannot assemble {packaged.gguf}: {exc}") from None


def _materialise_package(name: str, log_path: Path) -> tuple[Path, dict[str, Any]]:
    """A packaged GGUF model (SmolLM2, Gemma 3), dequantized once into an HF safetensors checkpoint."""
    gguf, pkg_version = _packaged_gguf(name)
    info = {"package": name, "revision": pkg_version, "gguf_sha256": file_sha256(gguf)}
    out = cache_root() / "sources" / f"{name}-{pkg_version}-{info['gguf_sha256'][:12]}"

    def materialise(tmp: Path) -> None:
        request = {"op": "materialise_gguf", "gguf_path": str(gguf), "out_dir": str(tmp)}
        check_step_request(ENV_TRANSFORMERS, request)
        result = run_step(ENV_TRANSFORMERS, request, log_path)  # the op's default time limit
        (tmp / ".pipeline-source.json").write_text(json.dumps({**info, **result}, indent=2))

    key = json_sha256({**info, "materialiser": MATERIALISER_VERSION})
    cached_step(out, key, materialise, out.with_name(f".{out.name}.lock"))
    return out, info
