"""One small async SQL interface over SQLite (stdlib ``sqlite3`` on a thread of its
own) and PostgreSQL (``asyncpg``), so :class:`batch.store.JobStore` holds one copy of
its SQL. Statements are written with ``?`` placeholders; the PostgreSQL adapter
numbers them (``$1``, ``$2``…). ``{skip_locked}`` in a statement becomes ``FOR UPDATE
OF i SKIP LOCKED`` on PostgreSQL (``i``: the claimed table's alias; rows another
replica is claiming are passed over) and nothing on SQLite (one writer at a time: the
whole statement is atomic).

Uploaded file bodies: under a folder with SQLite (one file per id), in a table with
PostgreSQL (so replicas on other hosts read them).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import sqlite3
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import asyncpg

Row = tuple[Any, ...]
#: What a store that cannot be reached (or fails) raises: callers answer 503.
STORE_ERRORS: tuple[type[BaseException], ...] = (
    OSError, sqlite3.Error, asyncpg.PostgresError, asyncpg.InterfaceError)


class Database(Protocol):
    """What the job store needs of a SQL database."""

    async def execute(self, sql: str, *args: Any) -> int:
        """Run one statement; the number of rows it changed."""

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        """Run one statement; its rows (also ``UPDATE … RETURNING``)."""

    async def execute_many(self, sql: str, rows: list[Sequence[Any]]) -> None:
        """Run one statement once per row of arguments."""

    def transaction(self) -> contextlib.AbstractAsyncContextManager[Database]:
        """Statements through the yielded handle commit together or not at all."""

    async def write_content(self, file_id: str, data: bytes) -> None: ...

    async def read_content(self, file_id: str) -> bytes | None: ...

    async def delete_content(self, file_id: str) -> None: ...

    async def close(self) -> None: ...


class SqliteDatabase:
    """SQLite in WAL mode on one connection, used from one thread (so the event loop
    never waits on disk); several processes may share the file (SQLite's lock, a
    ``busy_timeout`` of 10 s). Bodies under ``files_dir``.

    Raises:
        sqlite3.Error: from any statement.
    """

    dialect = "sqlite"

    def __init__(self, path: Path, files_dir: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        files_dir.mkdir(parents=True, exist_ok=True)
        self.files_dir = files_dir
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-sqlite")
        self._conn = self._pool.submit(self._connect, path).result()
        self._lock = asyncio.Lock()  # one transaction at a time on the connection

    @staticmethod
    def _connect(path: Path) -> sqlite3.Connection:
        conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA busy_timeout=10000")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    async def _run(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def _exec(self, sql: str, args: Sequence[Any]) -> tuple[int, list[Row]]:
        cur = self._conn.execute(sql.replace("{skip_locked}", ""), tuple(args))
        rows = cur.fetchall()
        return cur.rowcount, rows

    async def execute(self, sql: str, *args: Any) -> int:
        async with self._lock:
            return (await self._run(self._exec, sql, args))[0]

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        async with self._lock:
            return (await self._run(self._exec, sql, args))[1]

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[_SqliteTransaction]:
        async with self._lock:
            await self._run(self._conn.execute, "BEGIN IMMEDIATE")
            try:
                yield _SqliteTransaction(self)
            except BaseException:
                await self._run(self._conn.execute, "ROLLBACK")
                raise
            await self._run(self._conn.execute, "COMMIT")

    def _path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    async def write_content(self, file_id: str, data: bytes) -> None:
        def write() -> None:
            tmp = self._path(file_id).with_suffix(".part")
            tmp.write_bytes(data)
            tmp.replace(self._path(file_id))
        await self._run(write)

    async def read_content(self, file_id: str) -> bytes | None:
        def read() -> bytes | None:
            try:
                return self._path(file_id).read_bytes()
            except FileNotFoundError:
                return None
        return await self._run(read)

    async def delete_content(self, file_id: str) -> None:
        await self._run(lambda: self._path(file_id).unlink(missing_ok=True))

    async def close(self) -> None:
        await self._run(self._conn.close)
        self._pool.shutdown(wait=True)


class _SqliteTransaction:
    """The statements of one open SQLite transaction (its lock already held)."""

    def __init__(self, db: SqliteDatabase) -> None:
        self._db = db

    async def execute(self, sql: str, *args: Any) -> int:
        return (await self._db._run(self._db._exec, sql, args))[0]

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        return (await self._db._run(self._db._exec, sql, args))[1]

    async def execute_many(self, sql: str, rows: list[Sequence[Any]]) -> None:
        await self._db._run(self._db._conn.executemany, sql, rows)

    async def write_content(self, file_id: str, data: bytes) -> None:
        await self._db.write_content(file_id, data)


_PLACEHOLDER = re.compile(r"\?")


def _numbered(sql: str) -> str:
    counter = iter(range(1, 10_000))
    sql = sql.replace("{skip_locked}", "FOR UPDATE OF i SKIP LOCKED")
    return _PLACEHOLDER.sub(lambda _m: f"${next(counter)}", sql)


class PostgresDatabase:
    """PostgreSQL through an ``asyncpg`` pool (1–``max_size`` connections); bodies in
    the ``file_contents`` table.

    Raises:
        asyncpg.PostgresError, OSError: from any statement.
    """

    dialect = "postgresql"

    def __init__(self, pool: Any, conn: Any = None) -> None:
        self._pool = pool
        self._conn = conn  # inside a transaction: its connection

    @classmethod
    async def connect(cls, url: str, *, max_size: int = 8) -> PostgresDatabase:
        return cls(await asyncpg.create_pool(url, min_size=1, max_size=max_size))

    @staticmethod
    def _count(status: str) -> int:
        tail = status.rsplit(" ", 1)[-1]
        return int(tail) if tail.isdigit() else 0

    async def execute_many(self, sql: str, rows: list[Sequence[Any]]) -> None:
        if self._conn is not None:
            await self._conn.executemany(_numbered(sql), rows)
            return
        async with self._pool.acquire() as conn:
            await conn.executemany(_numbered(sql), rows)

    async def execute(self, sql: str, *args: Any) -> int:
        if self._conn is not None:
            return self._count(await self._conn.execute(_numbered(sql), *args))
        async with self._pool.acquire() as conn:
            return self._count(await conn.execute(_numbered(sql), *args))

    async def fetch(self, sql: str, *args: Any) -> list[Row]:
        if self._conn is not None:
            return [tuple(r) for r in await self._conn.fetch(_numbered(sql), *args)]
        async with self._pool.acquire() as conn:
            return [tuple(r) for r in await conn.fetch(_numbered(sql), *args)]

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[PostgresDatabase]:
        async with self._pool.acquire() as conn, conn.transaction():
            yield PostgresDatabase(self._pool, conn)

    async def write_content(self, file_id: str, data: bytes) -> None:
        await self.execute("INSERT INTO file_contents (id, content) VALUES (?, ?) "
                           "ON CONFLICT (id) DO UPDATE SET content = EXCLUDED.content",
                           file_id, data)

    async def read_content(self, file_id: str) -> bytes | None:
        rows = await self.fetch("SELECT content FROM file_contents WHERE id = ?", file_id)
        return bytes(rows[0][0]) if rows else None

    async def delete_content(self, file_id: str) -> None:
        await self.execute("DELETE FROM file_contents WHERE id = ?", file_id)

    async def close(self) -> None:
        await self._pool.close()
