"""The artifact registry: immutable versions of every target, stages that point at a version, and
the queries deploy jobs run.

Every publish of a target is a new version, kept under `artifacts/<recipe>/.versions/<target>/<N>/`
(pipeline.artifacts.keep_version); the workspace directory `artifacts/<recipe>/<target>/` holds the
current build. The manifests on disk are the truth; the index (`<artifacts>/registry.sqlite`) is
derived from them and can always be rebuilt (`pipeline registry rebuild`). A stage points at one
version and moves only when someone promotes; a rebuild never moves it. SQLite's own locking makes
concurrent builds and promotes safe: each write is one short transaction, with a busy timeout.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from pipeline.artifacts import (
    Layout,
    build_lock,
    keep_version,
    verify_files,
    version_numbers,
    versions_dir_of,
)
from pipeline.constants import (
    ENGINES,
    MANIFEST_NAME,
    STATUS_PASSED,
    VERSIONS_DIRNAME,
)
from pipeline.errors import BuildError, RegistryError
from pipeline.hashing import file_sha256
from pipeline.manifest import Manifest, parse_manifest, read_manifest
from pipeline.workspace import dvc_location, find_workspace, gto_assign

INDEX_NAME = "registry.sqlite"
STAGES = ("dev", "staging", "prod")
BUSY_TIMEOUT_S = 60  # how long a writer waits for another to finish
KEEP_VERSIONS = 3  # `registry gc` keeps the current, the staged and this many newest versions
SCHEMA_VERSION = 2  # 2: versions (1: one row per target, replaced by every rebuild)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    recipe TEXT NOT NULL, target TEXT NOT NULL, version INTEGER NOT NULL, path TEXT NOT NULL,
    kind TEXT, engine TEXT, format TEXT, quant TEXT, gpu_arch TEXT, status TEXT,
    manifest_sha256 TEXT NOT NULL, inputs_sha256 TEXT, manifest TEXT NOT NULL, registered_at TEXT,
    PRIMARY KEY (recipe, target, version)
);
CREATE TABLE IF NOT EXISTS verdicts (
    recipe TEXT NOT NULL, target TEXT NOT NULL, version INTEGER NOT NULL, engine TEXT NOT NULL,
    status TEXT NOT NULL, engine_version TEXT,
    PRIMARY KEY (recipe, target, version, engine)
);
CREATE TABLE IF NOT EXISTS current (
    recipe TEXT NOT NULL, target TEXT NOT NULL, version INTEGER NOT NULL, path TEXT NOT NULL,
    PRIMARY KEY (recipe, target)
);
CREATE TABLE IF NOT EXISTS stages (
    recipe TEXT NOT NULL, target TEXT NOT NULL, stage TEXT NOT NULL, version INTEGER NOT NULL,
    manifest_sha256 TEXT NOT NULL, promoted_at TEXT, dvc TEXT,
    PRIMARY KEY (recipe, target, stage)
);
"""
STAGES_JOURNAL = "stages.jsonl"  # beside a target's kept versions: one line per promote


@dataclass(frozen=True)
class Rebuilt:
    """What `rebuild` did: the targets indexed, and the stages it could not bring back (each
    `RECIPE/TARGET STAGE: why`), which it names instead of dropping them silently."""

    targets: int
    lost_stages: list[str]


class EngineStatus(BaseModel):
    """What the index keeps of one serving engine's verdict on a version."""

    status: str
    engine_version: str | None = None


class VersionEntry(BaseModel):
    """One kept version as the index holds it: what `registry list|history --json` print, and
    the head of `resolve`'s answer (same keys, same order)."""

    model_config = ConfigDict(frozen=True)
    recipe: str
    target: str
    version: int
    path: str  # the workspace directory when current (the same bytes), else the version's own
    kind: str
    engine: str
    format: str
    quant: str
    gpu_arch: str | None
    version_path: str
    current: bool
    status: str  # the primary engine's verdict
    manifest_sha256: str
    registered_at: str | None
    stages: list[str]
    engines: dict[str, EngineStatus]

    @property
    def ref(self) -> str:
        return f"{self.recipe}/{self.target}"


_VERSION_COLUMNS = ("recipe", "target", "version", "path", "kind", "engine", "format", "quant", "gpu_arch")


class Registry:
    """Index + queries over the artifacts under one root directory."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / INDEX_NAME

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        self.root.mkdir(parents=True, exist_ok=True)
        conn = _open_index(self.path)
        try:
            yield conn
        except sqlite3.OperationalError as exc:
            if _is_busy(exc):
                raise _locked(self.path, exc) from None
            raise _unreadable(self.path, exc) from None
        finally:
            conn.close()

    # --- writing -------------------------------------------------------------------------------

    def add_version(self, version_dir: Path, current: Path | None = None) -> int:
        """Index a kept version (`.versions/<target>/<N>/`); with `current`, it is also what the
        workspace directory `current` now holds. Returns N."""
        manifest = read_manifest(version_dir)
        number = int(version_dir.name)
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            _insert_version(db, version_dir, number, manifest)
            if current is not None:
                db.execute(
                    "INSERT OR REPLACE INTO current VALUES (?,?,?,?)",
                    (manifest.recipe, manifest.target, number, str(current.resolve())),
                )
            db.execute("COMMIT")
        return number

    def register(self, artifact_dir: Path) -> int:
        """Index the workspace directory of a target as its current version: the kept version with
        the same manifest, else (an artifact made before versions, or written by hand) a new
        version kept now. A manifest that does not match the schema is a RegistryError naming it."""
        read_manifest(artifact_dir)  # validates
        number = _matching_version(artifact_dir)
        if number is None:
            number, _ = keep_version(artifact_dir, versions_dir_of(artifact_dir))
        return self.add_version(versions_dir_of(artifact_dir) / str(number), current=artifact_dir)

    def rebuild(self) -> Rebuilt:
        """Recreate the index from the manifests on disk: every kept version, and each workspace
        directory as its target's current version (kept as a version first if it is not one).
        Stages come from the promote journals beside the versions and from the old index if it
        can be read (the later promote wins); each is kept where its version still exists with
        the same manifest, and named in `lost_stages` where not."""
        journaled = _journaled_stages(self.root)
        indexed = _old_stages(self.path) if self.path.exists() else []
        latest: dict[tuple[str, str, str], tuple[Any, ...]] = {}
        for row in [*indexed, *journaled]:
            key = (row[0], row[1], row[2])
            if key not in latest or (row[4] or "") >= (latest[key][4] or ""):
                latest[key] = row
        stages = list(latest.values())
        if self.path.exists():
            for suffix in ("", "-wal", "-shm"):
                Path(f"{self.path}{suffix}").unlink(missing_ok=True)
        workspaces = list(_workspace_dirs(self.root))
        for artifact_dir in workspaces:
            read_manifest(artifact_dir)  # a damaged manifest stops the rebuild, by name
            if _matching_version(artifact_dir) is None:
                keep_version(artifact_dir, versions_dir_of(artifact_dir))
        currents = {(d.parent.name, d.name): d for d in workspaces}
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            shas = {}
            for version_dir in _version_dirs(self.root):
                manifest = read_manifest(version_dir)
                number = int(version_dir.name)
                shas[(manifest.recipe, manifest.target, number)] = _insert_version(
                    db, version_dir, number, manifest
                )
            for (recipe, target), artifact_dir in currents.items():
                number = _matching_version(artifact_dir)
                db.execute(
                    "INSERT OR REPLACE INTO current VALUES (?,?,?,?)",
                    (recipe, target, number, str(artifact_dir.resolve())),
                )
            by_sha = {(r, t, sha): n for (r, t, n), sha in shas.items()}
            lost = []
            for recipe, target, stage, sha, promoted_at, coordinates in sorted(stages, key=lambda r: r[:3]):
                number = by_sha.get((recipe, target, sha))
                if number is None:
                    lost.append(
                        f"{recipe}/{target} {stage}: no kept version has the promoted manifest "
                        f"{sha[:16]}… (promoted {promoted_at})"
                    )
                    continue
                db.execute(
                    "INSERT OR REPLACE INTO stages VALUES (?,?,?,?,?,?,?)",
                    (recipe, target, stage, number, sha, promoted_at, coordinates),
                )
            db.execute("COMMIT")
        return Rebuilt(len({(recipe, target) for recipe, target, _ in shas}), lost)

    # --- reading -------------------------------------------------------------------------------

    def versions(self, include_failed: bool = True) -> list[VersionEntry]:
        """Every kept version with its stages, whether it is current, and each engine's verdict."""
        with self._db() as db:
            rows = db.execute(
                "SELECT v.recipe, v.target, v.version, v.path, v.kind, v.engine, v.format, v.quant, "
                "v.gpu_arch, v.status, v.manifest_sha256, v.registered_at, c.path, "
                "(SELECT group_concat(s.stage) FROM stages s WHERE s.recipe = v.recipe AND "
                "s.target = v.target AND s.version = v.version) "
                "FROM versions v LEFT JOIN current c ON c.recipe = v.recipe AND c.target = v.target "
                "AND c.version = v.version ORDER BY v.recipe, v.target, v.version"
            ).fetchall()
            verdicts = db.execute(
                "SELECT recipe, target, version, engine, status, engine_version FROM verdicts"
            ).fetchall()
        engines: dict[tuple[str, str, int], dict[str, EngineStatus]] = {}
        for recipe, target, number, engine, status, version in verdicts:
            engines.setdefault((recipe, target, number), {})[engine] = EngineStatus(
                status=status, engine_version=version
            )
        out = []
        for r in rows:
            fields = dict(zip(_VERSION_COLUMNS, r[:9], strict=True))
            entry = VersionEntry(
                **fields | {"path": r[12] or fields["path"]},  # current: the workspace dir, same bytes
                version_path=fields["path"],
                current=r[12] is not None,
                status=r[9],
                manifest_sha256=r[10],
                registered_at=r[11],
                stages=sorted(r[13].split(",")) if r[13] else [],
                engines=engines.get((fields["recipe"], fields["target"], fields["version"]), {}),
            )
            if include_failed or entry.status == STATUS_PASSED:
                out.append(entry)
        return out

    def entries(self, include_failed: bool = True) -> list[VersionEntry]:
        """Each target's current version (what `registry list` shows); validated ones (the
        primary engine's verdict `passed`) unless include_failed."""
        return [e for e in self.versions(include_failed) if e.current]

    def history(self, ref: str) -> list[VersionEntry]:
        """Every kept version of RECIPE/TARGET, oldest first."""
        recipe, target = _split(ref)
        found = [e for e in self.versions() if e.recipe == recipe and e.target == target]
        if not found:
            raise RegistryError(f"no artifact {ref} in the registry (try `pipeline registry list`)")
        return found

    def _manifest_text(self, entry: VersionEntry) -> str:
        with self._db() as db:
            (text,) = db.execute(
                "SELECT manifest FROM versions WHERE recipe = ? AND target = ? AND version = ?",
                (entry.recipe, entry.target, entry.version),
            ).fetchone()
        return text

    def manifest(self, entry: VersionEntry) -> Manifest:
        """The manifest registered for `entry`'s version, typed."""
        where = f"the registered manifest of {entry.ref} version {entry.version}"
        return parse_manifest(self._manifest_text(entry), where)

    def show(self, ref: str, version: int | None = None) -> dict[str, Any]:
        """The manifest of RECIPE/TARGET's current version (or `version`), with its path and number."""
        entry = self._entry(ref, version)
        return {"path": entry.path, "version": entry.version, **json.loads(self._manifest_text(entry))}

    def _unanchored(self, directory: Path) -> list[str]:
        """Without the sha256 `resolve` printed, a fetched manifest is only self-consistent: it must
        be one this registry recorded for its recipe/target (an edited manifest with matching file
        hashes would pass otherwise)."""
        manifest = read_manifest(directory)
        sha = file_sha256(directory / MANIFEST_NAME)
        known: set[str] = set()
        if self.path.is_file():  # a deploy host has no index: nothing is created for the question
            with self._db() as db:
                rows = db.execute(
                    "SELECT manifest_sha256 FROM versions WHERE recipe = ? AND target = ?",
                    (manifest.recipe, manifest.target),
                )
                known = {r[0] for r in rows}
        if sha in known:
            return []
        if not known:
            return [
                f"{MANIFEST_NAME}: nothing to check it against: this registry holds no "
                f"{manifest.recipe}/{manifest.target}; pass --manifest-sha256 (resolve prints it)"
            ]
        return [
            f"{MANIFEST_NAME}: matches no registered version of {manifest.recipe}/{manifest.target} "
            "(edited or from another registry); pass --manifest-sha256 (resolve prints it)"
        ]

    def _entry(self, ref: str, version: int | None) -> VersionEntry:
        found = self.history(ref)
        if version is None:
            current = [e for e in found if e.current] or found[-1:]
            return current[0]
        match = [e for e in found if e.version == version]
        if not match:
            known = ", ".join(str(e.version) for e in found)
            raise RegistryError(f"{ref} has no version {version} (versions: {known})")
        return match[0]

    def resolve(
        self,
        model: str,
        engine: str,
        quant: str,
        gpu_arch: str | None = None,
        stage: str | None = None,
        include_failed: bool = False,
        engine_version: str | None = None,
        gpus: int | None = None,
    ) -> dict[str, Any]:
        """Exactly one version for (model, engine, quant[, gpu arch][, stage][, engine version]),
        or a clear error: with `stage`, the version that stage points at; without, each target's
        newest version that passed. A version resolves for an engine only where that engine's own
        verdict is `passed` (a skipped engine never counts). Versions built for a GPU architecture
        (TensorRT-LLM engines) match only that architecture; `engine_version` matches the version
        of the engine that validated it. The answer says where the version's bytes are."""
        same = [
            e
            for e in self.versions()
            if e.recipe == model and engine in e.engines and e.quant.lower() == quant.lower()
        ]
        ok = [
            e
            for e in same
            if (include_failed or e.engines[engine].status == STATUS_PASSED)
            and (stage is None or stage in e.stages)
        ]
        newest: dict[tuple[str, str], VersionEntry] = {}
        for e in ok:  # ascending versions: the last one of each target wins
            newest[(e.recipe, e.target)] = e
        candidates = list(newest.values())
        matches = [e for e in candidates if gpu_arch is None or e.gpu_arch in (None, gpu_arch)]
        if engine_version is not None:
            matches = [e for e in matches if e.engines[engine].engine_version == engine_version]
        wide = {}  # a deploy host with `gpus` GPUs cannot serve a version sharded over more
        if gpus is not None:
            wide = {f"{e.recipe}/{e.target}": self.manifest(e).serve.tp_size for e in matches}
            matches = [e for e in matches if wide[f"{e.recipe}/{e.target}"] <= gpus]
        query = (
            f"model={model} engine={engine} quant={quant} gpu_arch={gpu_arch} stage={stage}"
            + (f" engine_version={engine_version}" if engine_version else "")
            + (f" gpus={gpus}" if gpus is not None else "")
        )
        if not matches and any(tp > (gpus or 0) for tp in wide.values()):
            needs = ", ".join(f"{name} (tp_size {tp})" for name, tp in sorted(wide.items()))
            raise RegistryError(
                f"nothing resolves {query}: the matching artifacts are sharded over more GPUs: {needs}"
            )
        if not matches:
            others = sorted({f"{e.gpu_arch} ({e.recipe}/{e.target})" for e in candidates if e.gpu_arch})
            if gpu_arch and others:
                raise RegistryError(
                    f"nothing resolves {query}: the matching artifacts were built for "
                    f"{', '.join(others)}, and an engine only runs on the GPU architecture that built it"
                )
            unvalidated = sorted(
                {
                    f"{e.recipe}/{e.target} ({engine} {e.engines[engine].status})"
                    for e in same
                    if e.engines[engine].status != STATUS_PASSED
                    and (stage is None or stage in e.stages)
                    and e.recipe + "/" + e.target not in {f"{r}/{t}" for r, t in newest}
                }
            )
            hint = (
                f" (artifacts whose validation did not pass are skipped: {', '.join(unvalidated)})"
                if unvalidated and not include_failed
                else ""
            )
            if stage is not None and not hint:
                hint = f" (no version is in stage {stage}: `pipeline registry promote` puts one there)"
            raise RegistryError(f"nothing resolves {query}{hint}")
        if len(matches) > 1:
            names = ", ".join(f"{m.recipe}/{m.target}" for m in matches)
            raise RegistryError(f"{query} is ambiguous: {names}; add --gpu-arch or --stage")
        entry = matches[0]
        manifest = self.show(f"{entry.recipe}/{entry.target}", entry.version)
        verdict = manifest["validation"]["engines"][engine]
        # the workspace's coordinates checked now; an older version's, as checked when it was promoted
        if entry.current:
            coordinates = dvc_location(Path(entry.path), entry.recipe, entry.target)
        else:
            coordinates = self._promoted_coordinates(entry.recipe, entry.target, entry.version)
        return {
            **entry.model_dump(mode="json"),
            "location": "workspace" if entry.current else "versions",
            "dvc": coordinates,
            "toolchain": manifest["toolchain"],
            "files": manifest["files"],
            "serve": manifest["serve"],
            "validation": {
                k: manifest["validation"].get(k) for k in ("status", "reason", "engine", "metrics")
            },
            "verdict": {k: verdict.get(k) for k in ("status", "reason", "engine_version", "metrics")},
        }

    def verify(self, ref: str, manifest_sha256: str | None = None, version: int | None = None) -> list[str]:
        """Re-hash an artifact against its manifest and the index; empty list when intact.

        `ref` is RECIPE/TARGET in this registry (its current version, or `version`), or the
        directory of a fetched artifact (a deploy job's copy): then its own manifest is checked,
        against `manifest_sha256` when given (the value `resolve` printed), and every file
        against the manifest.
        """
        if Path(ref).is_dir():
            problems = verify_fetched(Path(ref), manifest_sha256)
            return (
                problems
                if manifest_sha256 or problems[:1] == [_no_manifest(Path(ref))]
                else [*self._unanchored(Path(ref)), *problems]
            )
        entry = self._entry(ref, version)
        problems = []
        for directory in dict.fromkeys([Path(entry.path), Path(entry.version_path)]):
            manifest_path = directory / MANIFEST_NAME
            if not manifest_path.is_file():
                problems.append(f"{MANIFEST_NAME}: missing in {directory}")
                continue
            if file_sha256(manifest_path) != entry.manifest_sha256:
                problems.append(f"{MANIFEST_NAME}: changed since version {entry.version} was registered")
                continue
            files = read_manifest(directory).files
            problems += [p for p in verify_files(directory, files) if p not in problems]
        return problems

    # --- stages and retention ------------------------------------------------------------------

    def promote(
        self, ref: str, stage: str, version: int | None = None, local: bool = False
    ) -> dict[str, Any]:
        """Point `stage` at one version of RECIPE/TARGET (default: the current one); validated,
        intact versions only. The stage stays there until the next promote. In a git + DVC
        workspace the version must be fetchable by a deploy job elsewhere (true DVC coordinates),
        unless `local` (single host: deploy jobs read its kept copy here)."""
        if stage not in STAGES:
            raise RegistryError(f"unknown stage {stage!r} (known: {', '.join(STAGES)})")
        entry = self._entry(ref, version)
        name = f"{ref} version {entry.version}"
        if entry.status != STATUS_PASSED:
            raise RegistryError(f"{name} did not pass validation ({entry.status}); not promoted")
        problems = self.verify(ref, version=entry.version)
        if problems:
            raise RegistryError(f"{name} fails verification: {'; '.join(problems)}; not promoted")
        recipe, target = _split(ref)
        sha = entry.manifest_sha256
        in_workspace = find_workspace(Path(entry.path)) is not None
        location = None
        if in_workspace and not local:
            location = dvc_location(Path(entry.path), recipe, target) if entry.current else None
            location = location or self._promoted_coordinates(recipe, target, entry.version)
            why = (
                "; ".join(location["missing"])
                if location
                else "it is not the workspace's current version, so no commit's dvc.lock names it"
            )
            if location is None or not location["fetchable"]:
                raise RegistryError(
                    f"{name} cannot be fetched by a deploy job elsewhere: {why}. To resolve, do that "
                    "and promote again, or promote with --local (deploy jobs on this host only)"
                )
        # a GTO tag marks a commit whose lock describes the workspace: the current version only
        tag = (
            gto_assign(Path(entry.path), recipe, target, stage, sha, location)
            if entry.current and in_workspace and not local
            else None
        )
        now = datetime.now(UTC).isoformat(timespec="seconds")
        recorded = {**location, "checked_at": now} if location else None
        _journal_stage(
            Path(entry.version_path).parent,
            {
                "stage": stage,
                "version": entry.version,
                "manifest_sha256": sha,
                "promoted_at": now,
                "dvc": recorded,
            },
        )
        with self._db() as db:
            db.execute(
                "INSERT OR REPLACE INTO stages VALUES (?,?,?,?,?,?,?)",
                (
                    recipe,
                    target,
                    stage,
                    entry.version,
                    sha,
                    now,
                    json.dumps(recorded) if recorded else None,
                ),
            )
        return {
            "artifact": ref,
            "version": entry.version,
            "stage": stage,
            "manifest_sha256": sha,
            "gto_tag": tag,
            "local": local or not in_workspace,
        }

    def _promoted_coordinates(self, recipe: str, target: str, version: int) -> dict[str, Any] | None:
        """The DVC coordinates a version had when it was last promoted with them (the commit whose
        dvc.lock recorded its bytes, pushed): still true for a version the workspace moved past."""
        with self._db() as db:
            row = db.execute(
                "SELECT dvc FROM stages WHERE recipe = ? AND target = ? AND version = ? AND dvc IS NOT NULL "
                "ORDER BY promoted_at DESC LIMIT 1",
                (recipe, target, version),
            ).fetchone()
        return json.loads(row[0]) if row else None

    def gc(self, keep: int = KEEP_VERSIONS) -> dict[str, Any]:
        """Delete kept versions beyond the policy: every target keeps its current version, every
        staged version and its `keep` newest; the rest go (files and index rows). A target being
        built is skipped (its build lock is held) and named in the answer."""
        if keep < 1:
            raise RegistryError(f"--keep must be at least 1 (got {keep})")
        removed: list[str] = []
        busy: list[str] = []
        by_target: dict[tuple[str, str], list[VersionEntry]] = {}
        for e in self.versions():
            by_target.setdefault((e.recipe, e.target), []).append(e)
        for (recipe, target), found in by_target.items():
            newest = {e.version for e in found[-keep:]}
            doomed = [e for e in found if not (e.current or e.stages or e.version in newest)]
            if not doomed:
                continue
            try:
                with build_lock(Layout(self.root, recipe), target):
                    for e in doomed:
                        if self._forget(recipe, target, e.version):
                            shutil.rmtree(e.version_path)  # read-only files, writable dir
                            removed.append(f"{recipe}/{target} version {e.version}")
            except BuildError:
                busy.append(f"{recipe}/{target}")
        return {"removed": removed, "skipped_being_built": busy, "keep": keep}

    def _forget(self, recipe: str, target: str, version: int) -> bool:
        """Drop an unstaged version's index rows (False: it was promoted meanwhile; kept)."""
        where = "recipe = ? AND target = ? AND version = ?"
        with self._db() as db:
            db.execute("BEGIN IMMEDIATE")
            staged = db.execute(f"SELECT 1 FROM stages WHERE {where}", (recipe, target, version)).fetchone()
            if staged is None:
                for table in ("versions", "verdicts"):
                    db.execute(f"DELETE FROM {table} WHERE {where}", (recipe, target, version))
            db.execute("COMMIT")
        return staged is None


def _open_index(path: Path) -> sqlite3.Connection:
    """A connection to the index, its schema checked. Opening can meet SQLITE_BUSY that SQLite's
    busy handler does not cover (another process switching the file to WAL or closing it last
    and checkpointing; seen in CI with six writers), so opening is retried until BUSY_TIMEOUT_S."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    delay = 0.01
    while True:
        conn = None
        try:
            conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                conn.execute("PRAGMA journal_mode=WAL")
            if conn.execute("PRAGMA user_version").fetchone()[0] != SCHEMA_VERSION:
                _create_schema(conn, path)
            return conn
        except sqlite3.OperationalError as exc:
            if conn is not None:
                conn.close()
            if not _is_busy(exc):
                raise _unreadable(path, exc) from None
            if time.monotonic() > deadline:
                raise _locked(path, exc) from None
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
        except sqlite3.DatabaseError as exc:
            if conn is not None:
                conn.close()
            raise _unreadable(path, exc) from None


def _is_busy(exc: sqlite3.OperationalError) -> bool:
    return "locked" in str(exc) or "busy" in str(exc)


def _locked(path: Path, exc: Exception) -> RegistryError:
    return RegistryError(
        f"registry index {path} stayed locked for {BUSY_TIMEOUT_S} s ({exc}); another pipeline "
        "process holds it. To resolve, wait for it or stop it"
    )


def _unreadable(path: Path, exc: Exception) -> RegistryError:
    return RegistryError(
        f"registry index {path} is unreadable ({exc}). To resolve, run "
        "`pipeline registry rebuild`: the index is rebuilt from the manifests"
    )


def _create_schema(conn: sqlite3.Connection, path: Path) -> None:
    """Create the tables of a new index (one process does; the others wait and find them), or
    refuse an index of another schema."""
    conn.execute("BEGIN IMMEDIATE")
    (schema,) = conn.execute("PRAGMA user_version").fetchone()
    if schema != SCHEMA_VERSION:
        if conn.execute("SELECT count(*) FROM sqlite_master WHERE type='table'").fetchone()[0]:
            conn.execute("ROLLBACK")
            conn.close()
            raise RegistryError(
                f"registry index {path} has schema {schema}, not {SCHEMA_VERSION} (it predates "
                "versions). To resolve, run `pipeline registry rebuild`: the index is rebuilt from "
                "the manifests and keeps its stages"
            )
        for statement in _SCHEMA.split(";"):
            if statement.strip():
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    conn.execute("COMMIT")


def _no_manifest(directory: Path) -> str:
    return f"{MANIFEST_NAME}: missing in {directory}"


def verify_fetched(directory: Path, manifest_sha256: str | None = None) -> list[str]:
    """Problems with a fetched artifact directory (its manifest, then every file in it)."""
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        return [_no_manifest(directory)]
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


def _workspace_dirs(root: Path) -> Iterator[Path]:
    """Every target's workspace directory (artifacts/<recipe>/<target>/ with a manifest)."""
    if not root.is_dir():
        return
    for recipe_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        for target_dir in sorted(p for p in recipe_dir.iterdir() if p.is_dir()):
            if not target_dir.name.startswith(".") and (target_dir / MANIFEST_NAME).is_file():
                yield target_dir


def _version_dirs(root: Path) -> Iterator[Path]:
    """Every kept version (artifacts/<recipe>/.versions/<target>/<N>/)."""
    if not root.is_dir():
        return
    for recipe_dir in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        versions = recipe_dir / VERSIONS_DIRNAME
        if versions.is_dir():
            for target_dir in sorted(p for p in versions.iterdir() if p.is_dir()):
                for number in version_numbers(target_dir):
                    yield target_dir / str(number)


def _matching_version(artifact_dir: Path) -> int | None:
    """The kept version whose manifest is byte-identical to the workspace directory's."""
    sha = file_sha256(artifact_dir / MANIFEST_NAME)
    versions = versions_dir_of(artifact_dir)
    for number in reversed(version_numbers(versions)):
        kept = versions / str(number) / MANIFEST_NAME
        if kept.is_file() and file_sha256(kept) == sha:
            return number
    return None


def _journal_stage(versions_dir: Path, record: dict[str, Any]) -> None:
    """Append one promote to the target's journal (and make it durable) before the index
    records it: the index can be rebuilt from the journals."""
    with open(versions_dir / STAGES_JOURNAL, "a") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def _journaled_stages(root: Path) -> list[tuple[Any, ...]]:
    """(recipe, target, stage, manifest sha256, promoted_at, dvc coordinates) of every promote in
    the journals under `root`, in order; a torn last line (a crash mid-write) is skipped."""
    rows = []
    for journal in sorted(root.glob(f"*/{VERSIONS_DIRNAME}/*/{STAGES_JOURNAL}")):
        recipe, target = journal.parents[2].name, journal.parent.name
        for line in journal.read_text().splitlines():
            try:
                r = json.loads(line)
                coordinates = json.dumps(r["dvc"]) if r.get("dvc") else None
                rows.append((recipe, target, r["stage"], r["manifest_sha256"], r["promoted_at"], coordinates))
            except (ValueError, KeyError, TypeError):
                continue
    return rows


def _old_stages(path: Path) -> list[tuple[Any, ...]]:
    """(recipe, target, stage, manifest sha256, promoted_at, dvc coordinates or None) of an index
    about to be rebuilt, of either schema; none from an unreadable one."""
    try:
        conn = sqlite3.connect(path, timeout=60)
        try:
            columns = {r[1] for r in conn.execute("PRAGMA table_info(stages)")}
            coordinates = "dvc" if "dvc" in columns else "NULL"
            return conn.execute(
                f"SELECT recipe, target, stage, manifest_sha256, promoted_at, {coordinates} FROM stages"
            ).fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError:
        return []


def _insert_version(db: sqlite3.Connection, version_dir: Path, number: int, manifest: Manifest) -> str:
    """Replace one version's index rows; returns its manifest sha256."""
    sha = file_sha256(version_dir / MANIFEST_NAME)
    db.execute(
        "INSERT OR REPLACE INTO versions VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            manifest.recipe,
            manifest.target,
            number,
            str(version_dir.resolve()),
            manifest.kind,
            manifest.engine,
            manifest.format,
            manifest.quant,
            manifest.build.gpu_arch,
            manifest.validation.status,
            sha,
            manifest.build.inputs_sha256,
            manifest.to_json(),
            datetime.now(UTC).isoformat(timespec="seconds"),
        ),
    )
    db.execute(
        "DELETE FROM verdicts WHERE recipe = ? AND target = ? AND version = ?",
        (manifest.recipe, manifest.target, number),
    )
    db.executemany(
        "INSERT INTO verdicts VALUES (?,?,?,?,?,?)",
        [
            (
                manifest.recipe,
                manifest.target,
                number,
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
    versions = manifest.toolchain.get(ENGINES[engine].env, {})
    return next((versions[d] for d in ENGINES[engine].version_dists if versions.get(d)), None)
