"""The artifact registry: one SQLite index over every manifest, and the queries deploy jobs run.

The manifests are the truth; the index (`<artifacts>/registry.sqlite`) is derived from them and
can always be rebuilt (`pipeline registry rebuild`). SQLite's own locking makes concurrent
builds safe: each registration is one short write transaction, with a busy timeout.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pipeline.artifacts import iter_artifacts, verify_files
from pipeline.constants import ENGINE_VERSION_SOURCES, MANIFEST_NAME, STATUS_PASSED
from pipeline.errors import RegistryError
from pipeline.hashing import file_sha256
from pipeline.manifest import FileEntry, Manifest, read_manifest
from pipeline.workspace import dvc_location, gto_assign

INDEX_NAME = "registry.sqlite"
STAGES = ("dev", "staging", "prod")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS verdicts (
    recipe TEXT NOT NULL, target TEXT NOT NULL, engine TEXT NOT NULL,
    status TEXT NOT NULL, engine_version TEXT,
    PRIMARY KEY (recipe, target, engine)
);
CREATE TABLE IF NOT EXISTS artifacts (
    recipe TEXT NOT NULL, target TEXT NOT NULL, path TEXT NOT NULL,
    kind TEXT, engine TEXT, format TEXT, quant TEXT, gpu_arch TEXT,
    status TEXT, manifest_sha256 TEXT NOT NULL, manifest TEXT NOT NULL, registered_at TEXT,
    PRIMARY KEY (recipe, target)
);
CREATE TABLE IF NOT EXISTS stages (
    recipe TEXT NOT NULL, target TEXT NOT NULL, stage TEXT NOT NULL,
    manifest_sha256 TEXT NOT NULL, promoted_at TEXT,
    PRIMARY KEY (recipe, target, stage)
);
"""


class Registry:
    """Index + queries over the artifacts under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / INDEX_NAME

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            conn = sqlite3.connect(self.path, timeout=60, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise RegistryError(
                f"registry index {self.path} is unreadable ({exc}). To resolve, run "
                "`pipeline registry rebuild`: the index is rebuilt from the manifests"
            ) from None
        try:
            yield conn
        finally:
            conn.close()

    def register(self, artifact_dir: Path) -> None:
        """Add or replace one artifact's rows from its manifest (validated: a manifest that does
        not match the schema is a RegistryError naming it)."""
        manifest = read_manifest(artifact_dir)
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            _insert(db, artifact_dir, manifest)
            db.execute("COMMIT")

    def rebuild(self) -> int:
        """Recreate the index from the manifests on disk (stages kept where still valid)."""
        stages: list[tuple[Any, ...]] = []
        if self.path.exists():
            try:
                with self._db() as db:
                    stages = db.execute("SELECT * FROM stages").fetchall()
            except RegistryError:
                stages = []
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        found = list(iter_artifacts(self.root))
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            current = {(m.recipe, m.target): _insert(db, d, m) for d, m in found}
            db.executemany(
                "INSERT OR REPLACE INTO stages VALUES (?,?,?,?,?)",
                [s for s in stages if current.get((s[0], s[1])) == s[3]],
            )
            db.execute("COMMIT")
        return len(found)

    def entries(self, include_failed: bool = True) -> list[dict[str, Any]]:
        """Every registered artifact with its stages and each engine's verdict (`engines`);
        validated ones (the primary engine's verdict `passed`) unless include_failed."""
        with self._db() as db:
            rows = db.execute(
                "SELECT a.recipe, a.target, a.path, a.kind, a.engine, a.format, a.quant, a.gpu_arch, "
                "a.status, a.manifest_sha256, group_concat(s.stage) FROM artifacts a LEFT JOIN stages s "
                "ON s.recipe = a.recipe AND s.target = a.target AND s.manifest_sha256 = a.manifest_sha256 "
                "GROUP BY a.recipe, a.target ORDER BY a.recipe, a.target"
            ).fetchall()
            verdicts = db.execute(
                "SELECT recipe, target, engine, status, engine_version FROM verdicts"
            ).fetchall()
        engines: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
        for recipe, target, engine, status, version in verdicts:
            engines.setdefault((recipe, target), {})[engine] = {"status": status, "engine_version": version}
        keys = ("recipe", "target", "path", "kind", "engine", "format", "quant", "gpu_arch", "status")
        out = []
        for r in rows:
            entry = dict(zip(keys, r[:9], strict=True))
            entry["manifest_sha256"] = r[9]
            entry["stages"] = sorted((r[10] or "").split(",")) if r[10] else []
            entry["engines"] = engines.get((entry["recipe"], entry["target"]), {})
            if include_failed or entry["status"] == STATUS_PASSED:
                out.append(entry)
        return out

    def show(self, ref: str) -> dict[str, Any]:
        recipe, target = _split(ref)
        with self._db() as db:
            row = db.execute(
                "SELECT manifest, path FROM artifacts WHERE recipe = ? AND target = ?", (recipe, target)
            ).fetchone()
        if row is None:
            raise RegistryError(f"no artifact {ref} in the registry (try `pipeline registry list`)")
        return {"path": row[1], **json.loads(row[0])}

    def resolve(
        self,
        model: str,
        engine: str,
        quant: str,
        gpu_arch: str | None = None,
        stage: str | None = None,
        include_failed: bool = False,
        engine_version: str | None = None,
    ) -> dict[str, Any]:
        """Exactly one artifact for (model, engine, quant[, gpu arch][, stage][, engine version]),
        or a clear error. An artifact resolves for an engine only where that engine's own verdict
        is `passed` (a skipped engine never counts). Artifacts built for a GPU architecture
        (TensorRT-LLM engines) match only that architecture; `engine_version` matches the version
        of the engine that validated it."""
        same = [
            e
            for e in self.entries(include_failed=True)
            if e["recipe"] == model and engine in e["engines"] and e["quant"].lower() == quant.lower()
        ]
        candidates = [
            e
            for e in same
            if (include_failed or e["engines"][engine]["status"] == STATUS_PASSED)
            and (stage is None or stage in e["stages"])
        ]
        matches = [e for e in candidates if gpu_arch is None or e["gpu_arch"] in (None, gpu_arch)]
        if engine_version is not None:
            matches = [e for e in matches if e["engines"][engine]["engine_version"] == engine_version]
        query = f"model={model} engine={engine} quant={quant} gpu_arch={gpu_arch} stage={stage}" + (
            f" engine_version={engine_version}" if engine_version else ""
        )
        if not matches:
            others = sorted(
                {f"{e['gpu_arch']} ({e['recipe']}/{e['target']})" for e in candidates if e["gpu_arch"]}
            )
            if gpu_arch and others:
                raise RegistryError(
                    f"nothing resolves {query}: the matching artifacts were built for "
                    f"{', '.join(others)}, and an engine only runs on the GPU architecture that built it"
                )
            unvalidated = [
                f"{e['recipe']}/{e['target']} ({engine} {e['engines'][engine]['status']})"
                for e in same
                if e["engines"][engine]["status"] != STATUS_PASSED
            ]
            hint = (
                f" (artifacts whose validation did not pass are skipped: {', '.join(unvalidated)})"
                if unvalidated and not include_failed
                else ""
            )
            raise RegistryError(f"nothing resolves {query}{hint}")
        if len(matches) > 1:
            names = ", ".join(f"{m['recipe']}/{m['target']}" for m in matches)
            raise RegistryError(f"{query} is ambiguous: {names}; add --gpu-arch or --stage")
        entry = matches[0]
        manifest = self.show(f"{entry['recipe']}/{entry['target']}")
        verdict = manifest["validation"]["engines"][engine]
        return {
            **entry,
            "dvc": dvc_location(Path(entry["path"]), entry["recipe"], entry["target"]),
            "toolchain": manifest["toolchain"],
            "files": manifest["files"],
            "serve": manifest["serve"],
            "validation": {
                k: manifest["validation"].get(k) for k in ("status", "reason", "engine", "metrics")
            },
            "verdict": {k: verdict.get(k) for k in ("status", "reason", "engine_version", "metrics")},
        }

    def verify(self, ref: str, manifest_sha256: str | None = None) -> list[str]:
        """Re-hash an artifact against its manifest and the index; empty list when intact.

        `ref` is RECIPE/TARGET in this registry, or the directory of a fetched artifact (a deploy
        job's copy): then its own manifest is checked, against `manifest_sha256` when given
        (the value `resolve` printed), and every file against the manifest.
        """
        if Path(ref).is_dir():
            return verify_fetched(Path(ref), manifest_sha256)
        entry = self.show(ref)
        directory = Path(entry["path"])
        problems = verify_files(directory, [FileEntry.model_validate(f) for f in entry["files"]])
        manifest_path = directory / MANIFEST_NAME
        if not manifest_path.is_file():
            problems.append(f"{MANIFEST_NAME}: missing")
        else:
            with self._db() as db:
                (indexed,) = db.execute(
                    "SELECT manifest_sha256 FROM artifacts WHERE recipe = ? AND target = ?", _split(ref)
                ).fetchone()
            if file_sha256(manifest_path) != indexed:
                problems.append(f"{MANIFEST_NAME}: changed since it was registered")
        return problems

    def promote(self, ref: str, stage: str) -> dict[str, Any]:
        """Mark the current manifest of an artifact as being in `stage` (validated ones only)."""
        if stage not in STAGES:
            raise RegistryError(f"unknown stage {stage!r} (known: {', '.join(STAGES)})")
        entry = self.show(ref)
        if entry["validation"]["status"] != STATUS_PASSED:
            raise RegistryError(
                f"{ref} did not pass validation ({entry['validation']['status']}); not promoted"
            )
        problems = self.verify(ref)
        if problems:
            raise RegistryError(f"{ref} fails verification: {'; '.join(problems)}; not promoted")
        recipe, target = _split(ref)
        with self._db() as db:
            (sha,) = db.execute(
                "SELECT manifest_sha256 FROM artifacts WHERE recipe = ? AND target = ?", (recipe, target)
            ).fetchone()
        tag = gto_assign(Path(entry["path"]), recipe, target, stage, sha)
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO stages VALUES (?,?,?,?,?)",
                (recipe, target, stage, sha, datetime.now(UTC).isoformat(timespec="seconds")),
            )
        return {"artifact": ref, "stage": stage, "manifest_sha256": sha, "gto_tag": tag}


def verify_fetched(directory: Path, manifest_sha256: str | None = None) -> list[str]:
    """Problems with a fetched artifact directory (its manifest, then every file in it)."""
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        return [f"{MANIFEST_NAME}: missing in {directory}"]
    problems = []
    if manifest_sha256 and file_sha256(manifest_path) != manifest_sha256:
        problems.append(f"{MANIFEST_NAME}: sha256 differs from the registry's {manifest_sha256[:16]}…")
    manifest = read_manifest(directory)
    problems += verify_files(directory, manifest.files)
    listed = {f.path for f in manifest.files} | {MANIFEST_NAME}
    extra = sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.relative_to(directory).as_posix() not in listed
    )
    problems += [f"{path}: not in the manifest" for path in extra]
    return problems


def _split(ref: str) -> tuple[str, str]:
    recipe, sep, target = ref.partition("/")
    if not sep or not recipe or not target:
        raise RegistryError(f"artifact reference {ref!r} must be RECIPE/TARGET")
    return recipe, target


def _insert(db: sqlite3.Connection, artifact_dir: Path, manifest: Manifest) -> str:
    """Replace one artifact's index rows; returns its manifest sha256."""
    sha = file_sha256(artifact_dir / MANIFEST_NAME)
    db.execute(
        "INSERT OR REPLACE INTO artifacts VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            manifest.recipe,
            manifest.target,
            str(artifact_dir.resolve()),
            manifest.kind,
            manifest.engine,
            manifest.format,
            manifest.quant,
            manifest.build.gpu_arch,
            manifest.validation.status,
            sha,
            manifest.to_json(),
            datetime.now(UTC).isoformat(timespec="seconds"),
        ),
    )
    db.execute("DELETE FROM verdicts WHERE recipe = ? AND target = ?", (manifest.recipe, manifest.target))
    db.executemany(
        "INSERT INTO verdicts VALUES (?,?,?,?,?)",
        [
            (
                manifest.recipe,
                manifest.target,
                engine,
                v.status,
                v.engine_version or _toolchain_version(manifest, engine),
            )
            for engine, v in manifest.validation.engines.items()
        ],
    )
    return sha


def _toolchain_version(manifest: Manifest, engine: str) -> str | None:
    """The engine's version from the toolchain of its environment (a verdict that did not run)."""
    env, dists = ENGINE_VERSION_SOURCES[engine]
    versions = manifest.toolchain.get(env, {})
    return next((versions[d] for d in dists if versions.get(d)), None)
