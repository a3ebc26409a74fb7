"""The job store: files, batches and their lines in SQL (:mod:`batch.db`), chosen by
URL (:func:`open_job_store`, as :func:`limits.stores.open_store` chooses counter
stores).

A batch is created ``in_progress`` with one row per input line (``pending``). Gateway
processes claim lines with an expiring lease (``running``, ``owner``,
``lease_until``), renew the leases of lines they still run, and finish each with a
result (``done``: a 2xx answer; ``failed``: any other final answer) only while they
still hold its lease — a process that died or stalled past its lease loses the line
to the next claim, and its late result is dropped. The output and error files are
written from the rows once no line is left, so each ``custom_id`` appears exactly
once whatever ran twice. Expiry (``completion_window``) and cancellation end the
lines that have not finished as ``expired`` / ``cancelled`` (OpenAI's
``batch_expired`` / ``batch_cancelled`` error lines); finalising is one transaction
guarded by the batch's status, so replicas racing to finalise do it once.

Times are wall-clock seconds (``time.time``, injectable): leases must mean the same
to every replica, so hosts sharing PostgreSQL need synchronised clocks (well inside
``lease_ttl_s``).
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batch.db import Database, PostgresDatabase, SqliteDatabase
from batch.jsonl import Line

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS files (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL,
        filename TEXT NOT NULL, bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
        lines INTEGER NOT NULL DEFAULT 0)""",
    "CREATE INDEX IF NOT EXISTS files_tenant ON files (tenant, created_at)",
    """CREATE TABLE IF NOT EXISTS batches (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, endpoint TEXT NOT NULL,
        input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, metadata TEXT,
        status TEXT NOT NULL, errors TEXT, total INTEGER NOT NULL,
        completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
        expired INTEGER NOT NULL DEFAULT 0, cancelled INTEGER NOT NULL DEFAULT 0,
        output_file_id TEXT, error_file_id TEXT,
        created_at DOUBLE PRECISION NOT NULL, in_progress_at DOUBLE PRECISION,
        expires_at DOUBLE PRECISION, finalizing_at DOUBLE PRECISION,
        completed_at DOUBLE PRECISION, failed_at DOUBLE PRECISION,
        expired_at DOUBLE PRECISION, cancelling_at DOUBLE PRECISION,
        cancelled_at DOUBLE PRECISION)""",
    "CREATE INDEX IF NOT EXISTS batches_tenant ON batches (tenant, created_at)",
    "CREATE INDEX IF NOT EXISTS batches_status ON batches (status)",
    """CREATE TABLE IF NOT EXISTS items (
        batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT NOT NULL,
        url TEXT NOT NULL, body TEXT NOT NULL, state TEXT NOT NULL,
        owner TEXT, lease_until DOUBLE PRECISION, not_before DOUBLE PRECISION NOT NULL DEFAULT 0,
        attempts INTEGER NOT NULL DEFAULT 0, status_code INTEGER, response TEXT,
        request_id TEXT, finished_at DOUBLE PRECISION, output_tokens INTEGER,
        PRIMARY KEY (batch_id, idx))""",
    "CREATE INDEX IF NOT EXISTS items_state ON items (state, batch_id)",
]
PG_SCHEMA = ["CREATE TABLE IF NOT EXISTS file_contents (id TEXT PRIMARY KEY, content BYTEA NOT NULL)"]

#: A line's states; the last four are final.
PENDING, RUNNING, DONE, FAILED, EXPIRED, CANCELLED = (
    "pending", "running", "done", "failed", "expired", "cancelled")
#: Batch states with lines still to run.
ACTIVE = ("in_progress", "cancelling")
#: OpenAI's error lines for lines that never ran.
UNRUN_ERRORS = {
    EXPIRED: ("batch_expired", "This request could not be executed before the "
              "completion window expired."),
    CANCELLED: ("batch_cancelled", "This request was not executed because the batch "
                "was cancelled."),
}

_BATCH_COLS = ("id, tenant, endpoint, input_file_id, completion_window, metadata, status, "
               "errors, total, completed, failed, expired, cancelled, output_file_id, "
               "error_file_id, created_at, in_progress_at, expires_at, finalizing_at, "
               "completed_at, failed_at, expired_at, cancelling_at, cancelled_at")
_TIMES = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
          "failed_at", "expired_at", "cancelling_at", "cancelled_at")


def new_id(prefix: str) -> str:
    """An OpenAI-style id: ``prefix`` and 24 random hex characters."""
    return f"{prefix}-{secrets.token_hex(12)}" if prefix == "file" else \
        f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class FileRecord:
    """An uploaded (``purpose`` ``batch``) or generated (``batch_output``) file."""

    id: str
    tenant: str
    purpose: str
    filename: str
    bytes: int
    created_at: float
    lines: int = 0

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``FileObject``."""
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": int(self.created_at), "filename": self.filename,
                "purpose": self.purpose, "status": "processed", "expires_at": None,
                "status_details": None}


@dataclass
class BatchRecord:
    """One batch; ``counts``: lines per state while it runs (final counts after)."""

    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    status: str
    errors: list[dict[str, Any]] | None
    total: int
    completed: int = 0
    failed: int = 0
    expired: int = 0
    cancelled: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: dict[str, float | None] = field(default_factory=dict)

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's ``Batch`` object. ``request_counts.failed`` counts every line in
        the error file (failed, expired and cancelled ones); ``expired`` and
        ``cancelled`` are Sluice's own additions to ``request_counts``."""
        out: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "errors": None if not self.errors else {"object": "list", "data": self.errors},
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "metadata": self.metadata,
            "request_counts": {"total": self.total, "completed": self.completed,
                               "failed": self.failed + self.expired + self.cancelled,
                               "expired": self.expired, "cancelled": self.cancelled},
        }
        for name in _TIMES:
            value = self.times.get(name)
            out[name] = None if value is None else int(value)
        return out


@dataclass(frozen=True)
class Claimed:
    """A line this process holds the lease of."""

    batch_id: str
    idx: int
    custom_id: str
    url: str
    body: dict[str, Any]
    attempts: int


@dataclass(frozen=True)
class Progress:
    """An active batch's lines per state (metrics, dashboard)."""

    batch_id: str
    tenant: str
    status: str
    total: int
    done: int
    failed: int
    running: int
    created_at: float


def _batch(row: tuple[Any, ...]) -> BatchRecord:
    (bid, tenant, endpoint, input_file_id, window, metadata, status, errors, total,
     completed, failed, expired, cancelled, out_id, err_id, *times) = row
    return BatchRecord(bid, tenant, endpoint, input_file_id, window,
                       json.loads(metadata) if metadata else None, status,
                       json.loads(errors) if errors else None, total, completed, failed,
                       expired, cancelled, out_id, err_id, dict(zip(_TIMES, times, strict=True)))


def _file(row: tuple[Any, ...]) -> FileRecord:
    return FileRecord(*row)


class JobStore:
    """Files, batches and lines over a :class:`~batch.db.Database`.

    Args:
        db: the database (schema created by :meth:`migrate`).
        now: wall-clock seconds (default ``time.time``; tests inject their own).
    """

    def __init__(self, db: Database, now: Callable[[], float] = time.time) -> None:
        self.db = db
        self.now = now

    async def migrate(self) -> None:
        """Create the tables and indexes that do not exist yet."""
        pg = isinstance(self.db, PostgresDatabase)
        async with self.db.transaction() as tx:
            if pg:  # replicas starting together: one creates, the others wait
                await tx.execute("SELECT pg_advisory_xact_lock(7243001)")
            for stmt in SCHEMA + (PG_SCHEMA if pg else []):
                await tx.execute(stmt)

    async def close(self) -> None:
        await self.db.close()

    # ------------------------------------------------------------------ files

    async def add_file(self, tenant: str, purpose: str, filename: str, data: bytes,
                       lines: int = 0) -> FileRecord:
        """Store an uploaded file's body and record; the record."""
        rec = FileRecord(new_id("file"), tenant, purpose, filename, len(data), self.now(), lines)
        await self.db.write_content(rec.id, data)
        await self.db.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, "
                              "created_at, lines) VALUES (?, ?, ?, ?, ?, ?, ?)",
                              rec.id, tenant, purpose, filename, rec.bytes, rec.created_at, lines)
        return rec

    async def get_file(self, tenant: str, file_id: str) -> FileRecord | None:
        """``tenant``'s file ``file_id``, or None (another tenant's reads as absent)."""
        rows = await self.db.fetch("SELECT id, tenant, purpose, filename, bytes, created_at, "
                                   "lines FROM files WHERE id = ? AND tenant = ?", file_id, tenant)
        return _file(rows[0]) if rows else None

    async def list_files(self, tenant: str, limit: int, after: str | None = None,
                         purpose: str | None = None) -> list[FileRecord]:
        """``tenant``'s files, newest first, after the file ``after`` (a cursor)."""
        sql = ("SELECT id, tenant, purpose, filename, bytes, created_at, lines FROM files "
               "WHERE tenant = ?")
        args: list[Any] = [tenant]
        if purpose is not None:
            sql += " AND purpose = ?"
            args.append(purpose)
        if after is not None:
            sql += (" AND (created_at, id) < (SELECT created_at, id FROM files "
                    "WHERE id = ? AND tenant = ?)")
            args += [after, tenant]
        rows = await self.db.fetch(sql + " ORDER BY created_at DESC, id DESC LIMIT ?",
                                   *args, limit)
        return [_file(r) for r in rows]

    async def file_content(self, file_id: str) -> bytes | None:
        return await self.db.read_content(file_id)

    async def delete_file(self, tenant: str, file_id: str) -> bool:
        """Delete ``tenant``'s file; False when it has none of that id. A batch that
        reads it keeps its lines (they were copied when it was created)."""
        if not await self.db.execute("DELETE FROM files WHERE id = ? AND tenant = ?",
                                     file_id, tenant):
            return False
        await self.db.delete_content(file_id)
        return True

    # ------------------------------------------------------------------ batches

    async def create_batch(self, tenant: str, endpoint: str, input_file_id: str,
                           completion_window: str, window_s: float,
                           metadata: dict[str, str] | None, lines: list[Line],
                           errors: list[dict[str, Any]] | None = None) -> BatchRecord:
        """A new batch of ``lines``: ``in_progress``, or ``failed`` with ``errors``
        (then no line is stored)."""
        now = self.now()
        status = "failed" if errors else "in_progress"
        rec = BatchRecord(new_id("batch"), tenant, endpoint, input_file_id, completion_window,
                          metadata, status, errors, 0 if errors else len(lines),
                          times={"created_at": now, "expires_at": now + window_s,
                                 "in_progress_at": None if errors else now,
                                 "failed_at": now if errors else None})
        async with self.db.transaction() as tx:
            await tx.execute(
                "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, "
                "metadata, status, errors, total, created_at, in_progress_at, expires_at, "
                "failed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rec.id, tenant, endpoint, input_file_id, completion_window,
                json.dumps(metadata) if metadata else None, status,
                json.dumps(errors) if errors else None, rec.total, now,
                rec.times["in_progress_at"], rec.times["expires_at"], rec.times["failed_at"])
            if not errors:
                await tx.execute_many(
                    "INSERT INTO items (batch_id, idx, custom_id, url, body, state) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [(rec.id, idx, line.custom_id, line.url, json.dumps(line.body), PENDING)
                     for idx, line in enumerate(lines)])
        return rec

    async def get_batch(self, tenant: str | None, batch_id: str) -> BatchRecord | None:
        """The batch with live counts while it runs; None if absent or another
        tenant's (``tenant`` None: any tenant's, for operators)."""
        sql = f"SELECT {_BATCH_COLS} FROM batches WHERE id = ?"
        args: list[Any] = [batch_id]
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        rows = await self.db.fetch(sql, *args)
        if not rows:
            return None
        rec = _batch(rows[0])
        if rec.status in ACTIVE:
            await self._live_counts(rec)
        return rec

    async def _live_counts(self, rec: BatchRecord) -> None:
        rows = await self.db.fetch("SELECT state, COUNT(*) FROM items WHERE batch_id = ? "
                                   "GROUP BY state", rec.id)
        counts = dict(rows)
        rec.completed, rec.failed = counts.get(DONE, 0), counts.get(FAILED, 0)
        rec.expired, rec.cancelled = counts.get(EXPIRED, 0), counts.get(CANCELLED, 0)

    async def list_batches(self, tenant: str | None, limit: int,
                           after: str | None = None) -> list[BatchRecord]:
        """Batches newest first after the batch ``after`` (a cursor); ``tenant``
        None: every tenant's."""
        sql, args = f"SELECT {_BATCH_COLS} FROM batches WHERE 1 = 1", []
        if tenant is not None:
            sql += " AND tenant = ?"
            args.append(tenant)
        if after is not None:
            sql += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
            args.append(after)
        rows = await self.db.fetch(sql + " ORDER BY created_at DESC, id DESC LIMIT ?",
                                   *args, limit)
        out = [_batch(r) for r in rows]
        for rec in out:
            if rec.status in ACTIVE:
                await self._live_counts(rec)
        return out

    async def cancel_batch(self, tenant: str | None, batch_id: str) -> BatchRecord | None:
        """Cancel: the batch becomes ``cancelling`` and its lines that have not started
        never will (``cancelled``); lines running finish, then :meth:`finalize_due`
        makes it ``cancelled``. A batch already ended is returned unchanged. None if
        absent or another tenant's."""
        now = self.now()
        async with self.db.transaction() as tx:
            sql = "UPDATE batches SET status = 'cancelling', cancelling_at = ? " \
                  "WHERE id = ? AND status = 'in_progress'"
            args: list[Any] = [now, batch_id]
            if tenant is not None:
                sql += " AND tenant = ?"
                args.append(tenant)
            if await tx.execute(sql, *args):
                await tx.execute("UPDATE items SET state = ?, finished_at = ? "
                                 "WHERE batch_id = ? AND state = ?",
                                 CANCELLED, now, batch_id, PENDING)
        return await self.get_batch(tenant, batch_id)

    # ------------------------------------------------------------------ lines

    async def claim(self, owner: str, limit: int, lease_s: float) -> list[Claimed]:
        """Lease up to ``limit`` lines of ``in_progress`` batches to ``owner`` for
        ``lease_s`` s: pending lines due now, and running lines whose lease expired
        (their owner died or stalled), oldest batch first."""
        now = self.now()
        rows = await self.db.fetch(
            "UPDATE items SET state = ?, owner = ?, lease_until = ? "
            "WHERE (batch_id, idx) IN (SELECT i.batch_id, i.idx FROM items i "
            "JOIN batches b ON b.id = i.batch_id WHERE b.status = 'in_progress' AND "
            "((i.state = ? AND i.not_before <= ?) OR (i.state = ? AND i.lease_until < ?)) "
            "ORDER BY b.created_at, i.batch_id, i.idx LIMIT ? {skip_locked}) "
            "RETURNING batch_id, idx, custom_id, url, body, attempts",
            RUNNING, owner, now + lease_s, PENDING, now, RUNNING, now, limit)
        return sorted((Claimed(b, i, c, u, json.loads(body), a) for b, i, c, u, body, a in rows),
                      key=lambda c: (c.batch_id, c.idx))

    async def renew(self, owner: str, lease_s: float,
                    lines: list[tuple[str, int]]) -> int:
        """Extend the leases ``owner`` holds on ``lines`` (``(batch_id, idx)``) to now
        + ``lease_s``; how many it still held."""
        by_batch: dict[str, list[int]] = {}
        for batch_id, idx in lines:
            by_batch.setdefault(batch_id, []).append(idx)
        until, n = self.now() + lease_s, 0
        for batch_id, idxs in by_batch.items():
            marks = ", ".join("?" * len(idxs))
            n += await self.db.execute(
                f"UPDATE items SET lease_until = ? WHERE owner = ? AND state = ? "
                f"AND batch_id = ? AND idx IN ({marks})", until, owner, RUNNING, batch_id, *idxs)
        return n

    async def finish(self, owner: str, line: Claimed, status_code: int,
                     response: dict[str, Any], request_id: str,
                     output_tokens: int = 0) -> bool:
        """Record ``line``'s final answer (``done`` for 2xx, else ``failed``) if
        ``owner`` still holds its lease; False when it does not (the result is
        dropped: the line was claimed again, or its batch expired or was cancelled)."""
        state = DONE if 200 <= status_code < 300 else FAILED
        return bool(await self.db.execute(
            "UPDATE items SET state = ?, status_code = ?, response = ?, request_id = ?, "
            "output_tokens = ?, finished_at = ?, owner = NULL, lease_until = NULL "
            "WHERE batch_id = ? AND idx = ? AND state = ? AND owner = ?",
            state, status_code, json.dumps(response), request_id, output_tokens, self.now(),
            line.batch_id, line.idx, RUNNING, owner))

    async def retry_later(self, owner: str, line: Claimed, delay_s: float, *,
                          attempt: bool) -> bool:
        """Hand ``line`` back as pending, due in ``delay_s`` s (``attempt``: the try
        counts towards ``max_attempts``; a shed or rate-limited line's does not)."""
        return bool(await self.db.execute(
            "UPDATE items SET state = ?, owner = NULL, lease_until = NULL, not_before = ?, "
            "attempts = attempts + ? WHERE batch_id = ? AND idx = ? AND state = ? AND owner = ?",
            PENDING, self.now() + delay_s, 1 if attempt else 0, line.batch_id, line.idx,
            RUNNING, owner))

    async def release(self, owner: str) -> int:
        """Hand back every line ``owner`` holds, due at once (a clean shutdown)."""
        return await self.db.execute("UPDATE items SET state = ?, owner = NULL, "
                                     "lease_until = NULL WHERE owner = ? AND state = ?",
                                     PENDING, owner, RUNNING)

    # ------------------------------------------------------------------ finalising

    async def finalize_due(self) -> list[str]:
        """End the batches that are due: ``in_progress`` ones with no line left
        (``completed``) or past ``expires_at`` (``expired``: unfinished lines
        expire), ``cancelling`` ones with no live lease left (``cancelled``). Writes
        their output and error files. Returns the ids it ended."""
        now = self.now()
        rows = await self.db.fetch(
            "SELECT b.id, b.status, b.expires_at, "
            "(SELECT COUNT(*) FROM items i WHERE i.batch_id = b.id AND "
            " (i.state = ? OR (i.state = ? AND i.lease_until >= ?))) "
            "FROM batches b WHERE b.status IN ('in_progress', 'cancelling')",
            PENDING, RUNNING, now)
        ended = []
        for bid, status, expires_at, left in rows:
            if status == "in_progress" and expires_at is not None and expires_at <= now:
                end = ("expired", EXPIRED)
            elif left == 0:
                end = ("completed", None) if status == "in_progress" else ("cancelled", CANCELLED)
            else:
                continue
            if await self._finalize(bid, status, *end):
                ended.append(bid)
        return ended

    async def _finalize(self, batch_id: str, was: str, final: str, unrun: str | None) -> bool:
        now = self.now()
        async with self.db.transaction() as tx:
            # the guard: a replica that finalised first leaves nothing to update
            if not await tx.execute("UPDATE batches SET status = 'finalizing', finalizing_at = ? "
                                    "WHERE id = ? AND status = ?", now, batch_id, was):
                return False
            if unrun is not None:
                await tx.execute("UPDATE items SET state = ?, owner = NULL, lease_until = NULL, "
                                 "finished_at = ? WHERE batch_id = ? AND state IN (?, ?)",
                                 unrun, now, batch_id, PENDING, RUNNING)
            (tenant,), = await tx.fetch("SELECT tenant FROM batches WHERE id = ?", batch_id)
            rows = await tx.fetch("SELECT idx, custom_id, state, status_code, response, "
                                  "request_id FROM items WHERE batch_id = ? ORDER BY idx",
                                  batch_id)
            out, err, counts = _result_files(batch_id, rows)
            ids: dict[str, str | None] = {}
            for kind, data in (("output", out), ("error", err)):
                ids[kind] = None
                if data:
                    fid = new_id("file")
                    await tx.write_content(fid, data)
                    await tx.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, "
                                     "created_at, lines) VALUES (?, ?, ?, ?, ?, ?, ?)",
                                     fid, tenant, "batch_output", f"{batch_id}_{kind}.jsonl",
                                     len(data), now, data.count(b"\n"))
                    ids[kind] = fid
            await tx.execute(
                f"UPDATE batches SET status = ?, {final}_at = ?, completed = ?, failed = ?, "
                "expired = ?, cancelled = ?, output_file_id = ?, error_file_id = ? WHERE id = ?",
                final, now, counts[DONE], counts[FAILED], counts[EXPIRED], counts[CANCELLED],
                ids["output"], ids["error"], batch_id)
        return True

    async def progress(self) -> list[Progress]:
        """Every active batch's lines per state, oldest first."""
        rows = await self.db.fetch(
            "SELECT b.id, b.tenant, b.status, b.total, b.created_at, i.state, COUNT(i.idx) "
            "FROM batches b LEFT JOIN items i ON i.batch_id = b.id "
            "WHERE b.status IN ('in_progress', 'cancelling') "
            "GROUP BY b.id, b.tenant, b.status, b.total, b.created_at, i.state "
            "ORDER BY b.created_at")
        by: dict[str, dict[str, Any]] = {}
        for bid, tenant, status, total, created, state, n in rows:
            entry = by.setdefault(bid, {"tenant": tenant, "status": status, "total": total,
                                        "created_at": created})
            entry[state] = n
        return [Progress(bid, e["tenant"], e["status"], e["total"], e.get(DONE, 0),
                         e.get(FAILED, 0) + e.get(EXPIRED, 0) + e.get(CANCELLED, 0),
                         e.get(RUNNING, 0), e["created_at"]) for bid, e in by.items()]


def _result_files(batch_id: str, rows: list[tuple[Any, ...]]) -> tuple[bytes, bytes, dict[str, int]]:
    """The output file (2xx answers) and the error file (every other line), one line
    per ``custom_id`` in input order, in OpenAI's format; counts per state."""
    out, err = [], []
    counts = {DONE: 0, FAILED: 0, EXPIRED: 0, CANCELLED: 0}
    for idx, custom_id, state, status_code, response, request_id in rows:
        counts[state] = counts.get(state, 0) + 1
        line: dict[str, Any] = {"id": f"batch_req_{batch_id.split('_', 1)[-1]}_{idx}",
                                "custom_id": custom_id}
        if state in (DONE, FAILED):
            line["response"] = {"status_code": status_code, "request_id": request_id,
                                "body": json.loads(response)}
            line["error"] = None
        else:
            code, message = UNRUN_ERRORS[state]
            line["response"], line["error"] = None, {"code": code, "message": message}
        (out if state == DONE else err).append(json.dumps(line) + "\n")
    return "".join(out).encode(), "".join(err).encode(), counts


async def open_job_store(url: str, directory: str | Path = ".sluice/batch", *,
                         now: Callable[[], float] = time.time) -> JobStore:
    """Open (and migrate) the store for ``url`` (``BatchConfig.store_url``).

    Args:
        url: ``sqlite://`` (``<directory>/jobs.sqlite3``), ``sqlite:///PATH`` (that
            database; the files beside it in ``files/``), ``postgresql://…`` or
            ``postgres://…`` (asyncpg's URL).
        directory: the embedded store's folder.
        now: wall-clock seconds.

    Raises:
        ValueError: any other scheme.
        OSError, sqlite3.Error, asyncpg.PostgresError: the store cannot be opened.
    """
    if url.startswith("sqlite://"):
        path = Path(url[len("sqlite://"):]) if url != "sqlite://" else \
            Path(directory) / "jobs.sqlite3"
        db: Database = SqliteDatabase(path, path.parent / "files")
    elif url.startswith(("postgresql://", "postgres://")):
        db = await PostgresDatabase.connect(url)
    else:
        raise ValueError(f"unsupported job store URL {url!r}: use sqlite:// or postgresql://")
    store = JobStore(db, now)
    try:
        await store.migrate()
    except BaseException:
        await db.close()
        raise
    return store
