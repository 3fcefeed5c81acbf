"""The git + DVC workspace an artifact may live in: DVC URIs for `resolve`, GTO stage tags.

Only git, `dvc` and `gto` command lines are used (as subprocesses), so the core stays free of
their imports. Outside a git + DVC workspace every function here answers None or does nothing.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import RegistryError


@dataclass(frozen=True)
class Workspace:
    """A git work tree with DVC initialised (`.dvc/` and `dvc.yaml` at its top)."""

    root: Path

    def git(self, *args: str) -> str:
        res = subprocess.run(["git", *args], cwd=self.root, capture_output=True, text=True)
        if res.returncode != 0:
            raise RegistryError(f"git {' '.join(args)} failed in {self.root}: {res.stderr.strip()}")
        return res.stdout.strip()

    @property
    def url(self) -> str:
        """Where a deploy job clones it from: the `origin` remote, else the work tree itself."""
        res = subprocess.run(
            ["git", "config", "--get", "remote.origin.url"], cwd=self.root, capture_output=True, text=True
        )
        return res.stdout.strip() or str(self.root)

    def declared_artifacts(self) -> dict[str, dict[str, Any]]:
        """The `artifacts:` section of dvc.yaml (DVC's own model registry names)."""
        data = yaml.safe_load((self.root / "dvc.yaml").read_text()) or {}
        return data.get("artifacts") or {}


def find_workspace(path: Path) -> Workspace | None:
    """The git + DVC workspace containing `path`, if any."""
    for parent in [path.resolve(), *path.resolve().parents]:
        if (parent / ".dvc").is_dir() and (parent / "dvc.yaml").is_file() and (parent / ".git").exists():
            return Workspace(parent)
    return None


def artifact_name(recipe: str, target: str) -> str:
    """The artifact's name in DVC's `artifacts:` section and in GTO tags."""
    return f"{recipe}-{target}"


def dvc_location(artifact_dir: Path, recipe: str, target: str) -> dict[str, Any] | None:
    """How a deploy job elsewhere fetches this artifact with DVC, or None outside a workspace.

    `lock_committed` says whether HEAD's lock files are the ones in the work tree: only then does
    `rev` describe these bytes (commit the lock files and `dvc push` after a build).
    """
    ws = find_workspace(artifact_dir)
    if ws is None:
        return None
    rel = artifact_dir.resolve().relative_to(ws.root).as_posix()
    rev = ws.git("rev-parse", "HEAD")
    # every pipeline's lock file (dvc.lock, gpu/dvc.lock): modified or never committed
    dirty = ws.git("status", "--porcelain", "--", ":(glob)**/dvc.lock")
    name = artifact_name(recipe, target)
    location = {
        "repo": ws.url,
        "rev": rev,
        "path": rel,
        "lock_committed": not dirty,
        "get": f"dvc get {ws.url} {rel} --rev {rev} -o {target}",
    }
    if name in ws.declared_artifacts():
        location["artifact"] = name
    return location


def gto_assign(artifact_dir: Path, recipe: str, target: str, stage: str, manifest_sha256: str) -> str | None:
    """Tag HEAD `<name>#<stage>#N` with GTO when the artifact lives in a git + DVC workspace.

    Refused unless dvc.yaml declares the artifact and HEAD's dvc.lock is the work tree's (the
    tag must point at a commit whose lock file describes these bytes). Returns the tag.
    """
    ws = find_workspace(artifact_dir)
    if ws is None:
        return None
    name = artifact_name(recipe, target)
    rel = artifact_dir.resolve().relative_to(ws.root).as_posix()
    if name not in ws.declared_artifacts():
        raise RegistryError(
            f"{name} is not in dvc.yaml's `artifacts:` section. To resolve, add "
            f"`{name}: {{path: {rel}, type: model}}` there, commit, then promote again"
        )
    location = dvc_location(artifact_dir, recipe, target)
    if location is None or not location["lock_committed"]:
        raise RegistryError(
            f"dvc.lock has uncommitted changes in {ws.root}: a GTO tag on HEAD would not describe "
            "this artifact. To resolve, commit dvc.lock (and `dvc push`), then promote again"
        )
    gto = shutil.which("gto", path=str(Path(sys.executable).parent)) or shutil.which("gto")
    if gto is None:
        raise RegistryError("gto is not installed; install the project's `dvc` extra to tag stages")
    res = subprocess.run(
        [gto, "assign", name, "--stage", stage, "--message", f"manifest sha256 {manifest_sha256}"],
        cwd=ws.root,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        raise RegistryError(f"gto assign {name} --stage {stage} failed: {res.stderr.strip() or res.stdout}")
    tags = ws.git("tag", "--points-at", "HEAD", "--list", f"{name}#{stage}#*").split()
    return max(tags, key=lambda t: int(t.rsplit("#", 1)[1]))
