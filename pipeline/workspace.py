"""The git + DVC workspace an artifact may live in: DVC URIs for `resolve`, GTO stage tags.

Only git, `dvc` and `gto` command lines are used (as subprocesses), so the core stays free of
their imports. Outside a git + DVC workspace every function here answers None or does nothing.
"""

from __future__ import annotations

import json
import posixpath
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
    """A git work tree with a DVC project in it: at its top (`.dvc/` and `dvc.yaml` there), or in
    a subdirectory (`dvc init --subdir`: the GPU host's project, `gpu/`)."""

    root: Path  # the git work tree's top: paths in coordinates, `git show REV:PATH`
    dvc_root: Path  # the DVC project's directory: where `dvc` runs

    def git(self, *args: str) -> str:
        res = subprocess.run(["git", *args], cwd=self.root, capture_output=True, text=True)
        if res.returncode != 0:
            raise RegistryError(f"git {' '.join(args)} failed in {self.root}: {res.stderr.strip()}")
        return res.stdout.strip()

    @property
    def origin(self) -> str | None:
        """The `origin` remote's URL, if there is one."""
        res = subprocess.run(
            ["git", "config", "--get", "remote.origin.url"], cwd=self.root, capture_output=True, text=True
        )
        return res.stdout.strip() or None

    def on_origin(self, rev: str) -> bool:
        """Whether `rev` is on a branch of `origin` as this clone last saw it (its remote-tracking
        branches: updated by `git push` and `git fetch`; no network is used)."""
        branches = self.git("branch", "-r", "--contains", rev, "--format=%(refname:short)")
        return any(b.startswith("origin/") for b in branches.split())

    def dvc(self, *args: str) -> subprocess.CompletedProcess[str]:
        """Run the `dvc` installed beside this interpreter (else on PATH) in the DVC project."""
        dvc = shutil.which("dvc", path=str(Path(sys.executable).parent)) or shutil.which("dvc") or "dvc"
        return subprocess.run([dvc, *args], cwd=self.dvc_root, capture_output=True, text=True)

    def dvc_path(self, rel: str) -> str:
        """`rel` (a path from the work tree's top) as the DVC project names it."""
        return (self.root / rel).relative_to(self.dvc_root).as_posix()

    def lock_entry(self, rel: str, rev: str | None = None) -> dict[str, Any] | None:
        """The `outs` entry some dvc.lock records for the output `rel` (a path from the top):
        the work tree's lock files, or those committed at `rev`."""
        listed = self.git("ls-files", "--", ":(glob)**/dvc.lock") if rev else ""
        locks = (
            [Path(p) for p in listed.split()]
            if rev
            else [p.relative_to(self.root) for p in self.root.glob("**/dvc.lock") if ".dvc" not in p.parts]
        )
        for lock in locks:
            if rev:
                res = subprocess.run(
                    ["git", "show", f"{rev}:{lock.as_posix()}"], cwd=self.root, capture_output=True, text=True
                )
                if res.returncode != 0:
                    continue
                text = res.stdout
            else:
                text = (self.root / lock).read_text()
            stages = (yaml.safe_load(text) or {}).get("stages") or {}
            for stage in stages.values():
                for out in stage.get("outs") or []:
                    # paths in a lock file are relative to its directory (gpu/dvc.lock: gpu/artifacts/...)
                    if posixpath.normpath(f"{Path(lock).parent.as_posix()}/{out['path']}") == rel:
                        return out
        return None

    def declared_artifacts(self) -> dict[str, dict[str, Any]]:
        """The `artifacts:` section of the project's dvc.yaml (DVC's own model registry names)."""
        data = yaml.safe_load((self.dvc_root / "dvc.yaml").read_text()) or {}
        return data.get("artifacts") or {}


def find_workspace(path: Path) -> Workspace | None:
    """The git + DVC workspace containing `path`, if any: the nearest DVC project above it, in the
    git work tree above that."""
    parents = [path.resolve(), *path.resolve().parents]
    for i, parent in enumerate(parents):
        if (parent / ".dvc").is_dir() and (parent / "dvc.yaml").is_file():
            top = next((p for p in parents[i:] if (p / ".git").exists()), None)
            return Workspace(top, parent) if top is not None else None
    return None


def artifact_name(recipe: str, target: str) -> str:
    """The artifact's name in DVC's `artifacts:` section and in GTO tags."""
    return f"{recipe}-{target}"


def stale_stage(rel: str, status: dict[str, Any]) -> list[str]:
    """Why `dvc status REL --json` says REL's stage is not up to date, in words: its output's bytes
    differ from dvc.lock's, or (a clone without the stage's inputs, an edited recipe) only its
    inputs changed or are missing here."""
    outs, deps = [], []
    for entries in status.values():
        for entry in entries:
            if not isinstance(entry, dict):  # "always changed", "changed checksum"
                deps.append(str(entry))
                continue
            outs += [f"{path} {state}" for path, state in entry.get("changed outs", {}).items()]
            deps += [f"{path} {state}" for path, state in entry.get("changed deps", {}).items()]
    if outs:
        return [
            f"{rel} differs from what dvc.lock records: {', '.join(outs)} (run `dvc commit` or `dvc repro`)"
        ]
    if deps:
        return [f"{rel}'s stage is not up to date here: {', '.join(deps)} (run `dvc repro`)"]
    return []


def dvc_location(artifact_dir: Path, recipe: str, target: str) -> dict[str, Any] | None:
    """How a deploy job elsewhere fetches this artifact with DVC, or None outside a workspace.

    `fetchable` is true only when `dvc get REPO --rev REV` gives exactly these bytes: the work
    tree's bytes are what its dvc.lock records (`dvc status`), HEAD's committed lock records the
    same hash (`lock_committed`), HEAD is on a branch of `origin` where there is one (REPO is
    origin's URL then), and, where a default DVC remote is configured, it holds them
    (`dvc status -c`). Otherwise `missing` says what to do (commit the lock, push).
    """
    ws = find_workspace(artifact_dir)
    if ws is None:
        return None
    rel = artifact_dir.resolve().relative_to(ws.root).as_posix()
    rev = ws.git("rev-parse", "HEAD")
    missing = []
    here = ws.lock_entry(rel)
    status = ws.dvc("status", ws.dvc_path(rel), "--json")
    if here is None or status.returncode != 0:
        missing.append(f"{rel} is not an output of a DVC stage with a dvc.lock entry (run `dvc repro`)")
    else:
        missing += stale_stage(rel, json.loads(status.stdout or "{}"))
    committed = ws.lock_entry(rel, rev)
    same_lock = here is not None and committed is not None and committed.get("md5") == here.get("md5")
    lock_committed = same_lock and not missing  # HEAD's lock records the bytes in the work tree
    if here is not None and not same_lock:
        missing.append(
            f"the dvc.lock committed at {rev[:12]} records other bytes for {rel} (commit dvc.lock)"
        )
    origin = ws.origin  # one `git config` call; the printed repo is origin where there is one
    repo = origin or str(ws.root)
    if origin and not ws.on_origin(rev):
        missing.append(f"commit {rev[:12]} is on no branch of origin ({origin}) (run `git push`)")
    default_remote = ws.dvc("remote", "default")  # exit 1 and "No default remote set" when none
    if not missing and default_remote.returncode == 0 and default_remote.stdout.strip():
        remote = ws.dvc("status", "-c", ws.dvc_path(rel), "--json")
        if remote.returncode != 0 or json.loads(remote.stdout or "{}"):
            missing.append(f"the default DVC remote does not hold {rel} (run `dvc push`)")
    name = artifact_name(recipe, target)
    location = {
        "repo": repo,
        "rev": rev,
        "path": rel,
        "lock_committed": lock_committed,
        "fetchable": not missing,
        "missing": missing,
        "get": f"dvc get {repo} {rel} --rev {rev} -o {target}",
    }
    if name in ws.declared_artifacts():
        location["artifact"] = name
    return location


def gto_assign(
    artifact_dir: Path,
    recipe: str,
    target: str,
    stage: str,
    manifest_sha256: str,
    location: dict[str, Any] | None = None,
) -> str | None:
    """Tag HEAD `<name>#<stage>#N` with GTO when the artifact lives in a git + DVC workspace.

    Refused unless dvc.yaml declares the artifact and HEAD's dvc.lock is the work tree's (the
    tag must point at a commit whose lock file describes these bytes). `location`: the artifact's
    dvc_location if the caller has just checked it. Returns the tag.
    """
    ws = find_workspace(artifact_dir)
    if ws is None:
        return None
    name = artifact_name(recipe, target)
    rel = artifact_dir.resolve().relative_to(ws.root).as_posix()
    if name not in ws.declared_artifacts():
        raise RegistryError(
            f"{name} is not in {(ws.dvc_root / 'dvc.yaml').relative_to(ws.root)}'s `artifacts:` section. "
            f"To resolve, add `{name}: {{path: {ws.dvc_path(rel)}, type: model}}` there, commit, then "
            "promote again"
        )
    location = location or dvc_location(artifact_dir, recipe, target)
    if location is None or not location["lock_committed"]:
        why = "; ".join(location["missing"]) if location else "no DVC workspace"
        raise RegistryError(
            f"a GTO tag on HEAD would not describe this artifact: {why}. To resolve, do that, then "
            "promote again"
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
