"""Durable state of the Batch API: uploaded files, batches, their input lines
and each line's result, in one SQLite database (WAL mode); and the
Responses API's kept responses, which share it where ``--data-dir`` is set.

Owns every write and the invariants that make a batch exactly-once across a
crash: a line's result row and the batch's counters change in one
transaction, a result is keyed by ``(batch_id, line_no)`` so it can be
written once only, and a batch's output and error files are assembled from
the result rows in the same transaction that marks it done. After a
``kill -9`` the runner simply re-runs the lines that have no result.

Layout (one row each)::

    files    id, bytes, created_at, filename, purpose, content, on_disk
    batches  id, status, timestamps, counters, errors (JSON), metadata (JSON)
    lines    batch_id, line_no, custom_id, body (JSON)          input, parsed once
    results  batch_id, line_no, ok, line (JSON)                 one per finished line
    responses id, previous, record (JSON), used                 a kept response; ``used`` orders the LRU
    background id, request (JSON)                               a background response not yet finished

An uploaded file's content is ``<data_dir>/files/<id>`` (``on_disk``), so
that a 200 MB upload is copied in chunks rather than held as one bytes
object; output and error files stay in ``content``, written in the same
transaction that finishes their batch. An upload becomes durable on disk
before its row commits, so every row has its content; a crash in between
leaves a file without a row, removed at the next start.

A full disk or a corrupt database raises ``StoreError`` with a message that
says so; a failed write rolls back and leaves every committed row in place.
"""

from __future__ import annotations

import errno
import io
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence

DB_NAME = "fluidserve.sqlite3"
FILES_DIR = "files"
COPY_CHUNK = 1024 * 1024
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
FINAL_STATUSES = ("completed", "failed", "expired", "cancelled")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    content BLOB NOT NULL,
    on_disk INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    input_file_id TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    model TEXT,
    status TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    output_file_id TEXT,
    error_file_id TEXT,
    errors TEXT,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line_no INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_no)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL,
    line_no INTEGER NOT NULL,
    ok INTEGER NOT NULL,
    line TEXT NOT NULL,
    PRIMARY KEY (batch_id, line_no)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    previous TEXT,
    record TEXT NOT NULL,
    used INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_use ON responses (used);
CREATE TABLE IF NOT EXISTS background (
    id TEXT PRIMARY KEY,
    request TEXT NOT NULL
) WITHOUT ROWID;
"""


class StoreError(RuntimeError):
    """The store cannot be read or written (disk full, corrupt, locked);
    nothing already committed was changed."""


class MissingContent(StoreError):
    """A file's row is there but its content file is not (removed by hand,
    or a damaged disk): retrying cannot help."""


def new_id(prefix: str) -> str:
    """OpenAI-style ids: ``file-...``, ``batch_...``, ``batch_req_...``."""
    return f"{prefix}{secrets.token_hex(12)}"


@dataclass(frozen=True)
class FileRecord:
    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str


@dataclass(frozen=True)
class BatchLine:
    line_no: int
    custom_id: str
    body: dict[str, Any]
    url: str = ""  # the batch's endpoint; only run-batch lets lines differ


@dataclass(frozen=True)
class LineResult:
    """One finished line: ``line`` is the output-file JSON object."""

    line_no: int
    ok: bool
    line: dict[str, Any]
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass
class BatchRecord:
    id: str
    input_file_id: str
    endpoint: str
    completion_window: str
    status: str
    created_at: int
    metadata: dict[str, str] | None = None
    model: str | None = None
    expires_at: int | None = None
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    errors: list[dict[str, Any]] | None = None
    total: int = 0
    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


_BATCH_COLUMNS = [f for f in BatchRecord.__dataclass_fields__]
_TIMESTAMPS = {"in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
               "cancelled_at"}


@dataclass
class _Page:
    items: list[Any] = field(default_factory=list)
    has_more: bool = False


class Store:
    """One SQLite connection shared by the server's threads under a lock
    (calls are short; the async side runs them in a worker thread)."""

    def __init__(self, data_dir: str | os.PathLike, *, max_pages: int | None = None) -> None:
        self.dir = Path(data_dir)
        self.path = self.dir / DB_NAME
        self.files_dir = self.dir / FILES_DIR
        self.max_pages = max_pages
        self._lock = threading.Lock()
        try:
            self.files_dir.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the batch store {self.path}: {exc}") from None
        try:
            self._open(max_pages)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise StoreError(
                f"the batch store {self.path} is unreadable ({exc}); it was left untouched: move it aside "
                f"or restore it from a backup, then restart") from None
        except OSError as exc:
            self._db.close()
            raise StoreError(f"cannot open the batch store's files {self.files_dir}: {exc}") from None

    def _open(self, max_pages: int | None) -> None:
        db = self._db
        # synchronous=FULL: a result reported as committed survives power loss
        # too, not only a killed process.
        mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.DatabaseError(f"could not switch to WAL mode (got {mode})")
        db.execute("PRAGMA synchronous=FULL")
        db.execute("PRAGMA busy_timeout=5000")
        check = db.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {check}")
        if max_pages is not None:  # a size cap, so tests can fill the "disk"
            db.execute(f"PRAGMA max_page_count={int(max_pages)}")
        db.executescript(_SCHEMA)
        if "on_disk" not in {row[1] for row in db.execute("PRAGMA table_info(files)")}:
            # A store from before uploads went to disk: its rows keep their content.
            db.execute("ALTER TABLE files ADD COLUMN on_disk INTEGER NOT NULL DEFAULT 0")
        self._remove_strays({row[0] for row in db.execute("SELECT id FROM files WHERE on_disk=1")})

    def _remove_strays(self, ids: set[str]) -> None:
        """Unfinished uploads and content whose row never committed (or was
        deleted) when the last process stopped."""
        for entry in self.files_dir.iterdir():
            if entry.name not in ids and entry.is_file():
                entry.unlink(missing_ok=True)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- plumbing -----------------------------------------------------------
    def _read(self, sql: str, args: Sequence[Any] = ()) -> list[tuple]:
        with self._lock:
            try:
                return self._db.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise _store_error(self.path, exc) from None

    def _write(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(db, *args)`` in one immediate transaction: all or nothing."""
        with self._lock:
            db = self._db
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(db, *args)
                except BaseException:
                    if db.in_transaction:  # SQLite already rolled back a failed statement (disk full)
                        db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
                return out
            except sqlite3.Error as exc:
                if db.in_transaction:
                    try:
                        db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                raise _store_error(self.path, exc) from None

    # -- files --------------------------------------------------------------
    def create_file(self, filename: str, purpose: str, content: bytes) -> FileRecord:
        return self.add_file(filename, purpose, io.BytesIO(content))

    def add_file(self, filename: str, purpose: str, source: BinaryIO) -> FileRecord:
        """Copy ``source`` (read from where it stands) into the files folder
        a chunk at a time, make it durable, then commit its row. A failure at
        any step leaves neither the file nor the row."""
        rec_id = new_id("file-")
        final = self.files_dir / rec_id
        tmp = self.files_dir / f"{rec_id}.tmp"
        room = self._room()
        try:
            size = 0
            with open(tmp, "xb") as out:
                while chunk := source.read(COPY_CHUNK):
                    size += len(chunk)
                    if room is not None and size > room:
                        raise OSError(errno.ENOSPC, "the store's size cap is reached")
                    out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, final)
            _fsync_dir(self.files_dir)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            final.unlink(missing_ok=True)
            raise _os_error(self.path, exc) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            final.unlink(missing_ok=True)
            raise
        rec = FileRecord(rec_id, size, int(time.time()), filename, purpose)

        def insert(db: sqlite3.Connection) -> None:
            if self.max_pages is not None and _used_bytes(db) + size > self.max_pages * _page_size(db):
                raise sqlite3.OperationalError("database or disk is full")  # the cap, as the disk would say it
            db.execute("INSERT INTO files (id, bytes, created_at, filename, purpose, content, on_disk) "
                       "VALUES (?,?,?,?,?,?,1)", (rec.id, rec.bytes, rec.created_at, rec.filename, rec.purpose, b""))

        try:
            self._write(insert)
        except BaseException:
            final.unlink(missing_ok=True)
            raise
        return rec

    def _room(self) -> int | None:
        """Bytes a new file may take under ``max_pages``, which caps the
        database and the uploaded files together; None when uncapped."""
        if self.max_pages is None:
            return None
        with self._lock:
            try:
                return self.max_pages * _page_size(self._db) - _used_bytes(self._db)
            except sqlite3.Error as exc:
                raise _store_error(self.path, exc) from None

    def get_file(self, file_id: str) -> FileRecord | None:
        rows = self._read("SELECT id, bytes, created_at, filename, purpose FROM files WHERE id=?", (file_id,))
        return FileRecord(*rows[0]) if rows else None

    def open_file(self, file_id: str) -> BinaryIO | None:
        """A file's content to read from the start, or None when there is no
        such file. Opened under the lock, so a concurrent ``delete_file``
        either finds it open (and the reader keeps its content) or already
        gone."""
        with self._lock:
            try:
                rows = self._db.execute("SELECT on_disk, CASE WHEN on_disk THEN NULL ELSE content END "
                                        "FROM files WHERE id=?", (file_id,)).fetchall()
            except sqlite3.Error as exc:
                raise _store_error(self.path, exc) from None
            if not rows:
                return None
            on_disk, content = rows[0]
            if not on_disk:
                return io.BytesIO(content)
            try:
                return open(self.files_dir / file_id, "rb")
            except FileNotFoundError:
                raise MissingContent(f"the content of {file_id} is missing from {self.files_dir}") from None
            except OSError as exc:
                raise _os_error(self.path, exc) from None

    def list_files(self, *, after: str | None, limit: int, order: str, purpose: str | None) -> _Page:
        desc = order == "desc"
        where, args = ["1=1"], []
        if purpose is not None:
            where.append("purpose=?")
            args.append(purpose)
        if after is not None:
            where.append(f"seq {'<' if desc else '>'} (SELECT seq FROM files WHERE id=?)")
            args.append(after)
        rows = self._read(
            f"SELECT id, bytes, created_at, filename, purpose FROM files WHERE {' AND '.join(where)} "
            f"ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?", (*args, limit + 1))
        return _Page([FileRecord(*r) for r in rows[:limit]], len(rows) > limit)

    def delete_file(self, file_id: str) -> bool:
        def run(db: sqlite3.Connection) -> list[tuple]:
            rows = db.execute("SELECT on_disk FROM files WHERE id=?", (file_id,)).fetchall()
            db.execute("DELETE FROM files WHERE id=?", (file_id,))
            return rows

        rows = self._write(run)
        if rows and rows[0][0]:
            try:
                (self.files_dir / file_id).unlink(missing_ok=True)
            except OSError:
                pass  # the row is gone: the next start removes the content
        return bool(rows)

    # -- batches ------------------------------------------------------------
    def create_batch(self, rec: BatchRecord) -> None:
        self._write(_insert_batch, rec)

    def get_batch(self, batch_id: str) -> BatchRecord | None:
        rows = self._read(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE id=?", (batch_id,))
        return _batch_from_row(rows[0]) if rows else None

    def list_batches(self, *, after: str | None, limit: int) -> _Page:
        """Newest first, as OpenAI lists them."""
        where, args = "", []
        if after is not None:
            where, args = "WHERE seq < (SELECT seq FROM batches WHERE id=?)", [after]
        rows = self._read(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches {where} ORDER BY seq DESC LIMIT ?",
                          (*args, limit + 1))
        return _Page([_batch_from_row(r) for r in rows[:limit]], len(rows) > limit)

    def active_batches(self) -> list[BatchRecord]:
        """Batches still to be worked on, oldest first."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        rows = self._read(f"SELECT {', '.join(_BATCH_COLUMNS)} FROM batches WHERE status IN ({marks}) "
                          f"ORDER BY seq ASC", ACTIVE_STATUSES)
        return [_batch_from_row(r) for r in rows]

    def count_batches_by_status(self) -> dict[str, int]:
        return {s: n for s, n in self._read("SELECT status, COUNT(*) FROM batches GROUP BY status")}

    def set_status(self, batch_id: str, status: str, *, only_from: Sequence[str] | None = None,
                   now: int | None = None) -> bool:
        """Move a batch to ``status`` (stamping ``<status>_at`` when OpenAI
        has such a timestamp); with ``only_from``, only out of those states.
        Returns whether the batch moved."""
        return self._write(_set_status, batch_id, status, only_from, now or int(time.time()))

    def start_batch(self, batch_id: str, lines: list[BatchLine]) -> bool:
        """Store the validated input lines and move validating -> in_progress,
        atomically (a crash in between re-validates the file)."""

        def run(db: sqlite3.Connection) -> bool:
            if not _set_status(db, batch_id, "in_progress", ("validating",), int(time.time())):
                return False
            db.executemany("INSERT INTO lines (batch_id, line_no, custom_id, body) VALUES (?,?,?,?)",
                           [(batch_id, ln.line_no, ln.custom_id, json.dumps(ln.body)) for ln in lines])
            db.execute("UPDATE batches SET total=? WHERE id=?", (len(lines), batch_id))
            return True

        return self._write(run)

    def fail_batch(self, batch_id: str, errors: list[dict[str, Any]]) -> bool:
        def run(db: sqlite3.Connection) -> bool:
            if not _set_status(db, batch_id, "failed", ("validating",), int(time.time())):
                return False
            db.execute("UPDATE batches SET errors=? WHERE id=?", (json.dumps(errors), batch_id))
            return True

        return self._write(run)

    def pending_lines(self, batch_id: str, limit: int, after_line: int = -1) -> list[BatchLine]:
        """Input lines with no result yet, in line order, past ``after_line``."""
        rows = self._read(
            "SELECT l.line_no, l.custom_id, l.body FROM lines l LEFT JOIN results r "
            "ON r.batch_id = l.batch_id AND r.line_no = l.line_no "
            "WHERE l.batch_id=? AND r.line_no IS NULL AND l.line_no > ? ORDER BY l.line_no LIMIT ?",
            (batch_id, after_line, limit))
        return [BatchLine(n, c, json.loads(b)) for n, c, b in rows]

    def record_result(self, batch_id: str, result: LineResult) -> bool:
        """Commit one line's result and the batch's counters together.
        False (and no change) when the line already has a result."""

        def run(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
            if row is None or row[0] in FINAL_STATUSES:  # a line that raced a cancel lands nowhere
                return False
            cur = db.execute("INSERT OR IGNORE INTO results (batch_id, line_no, ok, line) VALUES (?,?,?,?)",
                             (batch_id, result.line_no, int(result.ok), json.dumps(result.line)))
            if cur.rowcount == 0:
                return False
            counter = "completed" if result.ok else "failed"
            db.execute(f"UPDATE batches SET {counter}={counter}+1, input_tokens=input_tokens+?, "
                       f"output_tokens=output_tokens+? WHERE id=?",
                       (result.input_tokens, result.output_tokens, batch_id))
            return True

        return self._write(run)

    def finish_batch(self, batch_id: str, status: str, only_from: Sequence[str],
                     unfinished_error: dict[str, Any] | None = None) -> bool:
        """Write the output and error files from the results and move the
        batch from one of ``only_from`` to its final ``status``, in one
        transaction (so a cancel racing a completion cannot be overwritten).
        Lines without a result get ``unfinished_error`` in the error file
        when given (an expired batch), and are left out otherwise."""
        return self._write(_finish, batch_id, status, only_from, unfinished_error)

    def results(self, batch_id: str) -> Iterator[tuple[int, bool, dict[str, Any]]]:
        for n, ok, line in self._read("SELECT line_no, ok, line FROM results WHERE batch_id=? ORDER BY line_no",
                                      (batch_id,)):
            yield n, bool(ok), json.loads(line)

    # -- kept responses -----------------------------------------------------
    def put_response(self, response_id: str, previous: str | None, record: dict[str, Any], capacity: int,
                     continued: Sequence[str] = (), request: dict[str, Any] | None = None) -> list[str]:
        """Keep a response as the most recently used, the turns it
        continues (``continued``) just before it, and drop the least
        recently used beyond ``capacity``: the ids dropped. ``request``: a
        background response accepted and not yet finished, kept with the
        body it is to be run from (after a restart too); None: finished."""

        def run(db: sqlite3.Connection) -> list[str]:
            used = db.execute("SELECT COALESCE(MAX(used), 0) FROM responses").fetchone()[0]
            db.executemany("UPDATE responses SET used=? WHERE id=?",
                           [(used + 1 + i, rid) for i, rid in enumerate(reversed(continued))])
            db.execute("INSERT OR REPLACE INTO responses (id, previous, record, used) VALUES (?,?,?,?)",
                       (response_id, previous, json.dumps(record), used + 1 + len(continued)))
            if request is not None:
                db.execute("INSERT OR REPLACE INTO background (id, request) VALUES (?,?)",
                           (response_id, json.dumps(request)))
            else:
                db.execute("DELETE FROM background WHERE id=?", (response_id,))
            dropped = [row[0] for row in db.execute(
                "SELECT id FROM responses ORDER BY used DESC LIMIT -1 OFFSET ?", (capacity,))]
            db.executemany("DELETE FROM responses WHERE id=?", [(rid,) for rid in dropped])
            db.executemany("DELETE FROM background WHERE id=?", [(rid,) for rid in dropped])
            return dropped

        return self._write(run)

    def pending_responses(self) -> list[tuple[str, str | None, dict[str, Any], dict[str, Any]]]:
        """(id, previous id, record, request) of every background response
        accepted and not finished, oldest first: to run after a restart."""
        rows = self._read("SELECT r.id, r.previous, r.record, b.request FROM background b "
                          "JOIN responses r ON r.id = b.id ORDER BY r.used")
        return [(rid, previous, json.loads(record), json.loads(request)) for rid, previous, record, request in rows]

    def get_response(self, response_id: str) -> tuple[str | None, dict[str, Any]] | None:
        """(previous id, record) of a kept response."""
        rows = self._read("SELECT previous, record FROM responses WHERE id=?", (response_id,))
        return (rows[0][0], json.loads(rows[0][1])) if rows else None

    def delete_response(self, response_id: str) -> bool:
        def run(db: sqlite3.Connection) -> bool:
            db.execute("DELETE FROM background WHERE id=?", (response_id,))
            return db.execute("DELETE FROM responses WHERE id=?", (response_id,)).rowcount > 0

        return self._write(run)


# -- transaction bodies (run inside Store._write) ---------------------------


def _insert_batch(db: sqlite3.Connection, rec: BatchRecord) -> None:
    values = [getattr(rec, c) for c in _BATCH_COLUMNS]
    for i, c in enumerate(_BATCH_COLUMNS):
        if c in ("metadata", "errors") and values[i] is not None:
            values[i] = json.dumps(values[i])
    db.execute(f"INSERT INTO batches ({', '.join(_BATCH_COLUMNS)}) VALUES ({', '.join('?' * len(values))})",
               values)


def _set_status(db: sqlite3.Connection, batch_id: str, status: str, only_from: Sequence[str] | None,
                now: int) -> bool:
    stamp = f"{status}_at"
    sets = "status=?" + (f", {stamp}=?" if stamp in _TIMESTAMPS else "")
    args: list[Any] = [status] + ([now] if stamp in _TIMESTAMPS else [])
    sql = f"UPDATE batches SET {sets} WHERE id=?"
    args.append(batch_id)
    if only_from is not None:
        sql += f" AND status IN ({','.join('?' * len(only_from))})"
        args.extend(only_from)
    return db.execute(sql, args).rowcount > 0


def _finish(db: sqlite3.Connection, batch_id: str, status: str, only_from: Sequence[str],
            unfinished_error: dict[str, Any] | None) -> bool:
    row = db.execute("SELECT status FROM batches WHERE id=?", (batch_id,)).fetchone()
    if row is None or row[0] not in only_from:
        return False
    out: list[str] = []
    err: list[str] = []
    results = db.execute("SELECT line_no, ok, line FROM results WHERE batch_id=? ORDER BY line_no", (batch_id,))
    for _, ok, line in results:
        (out if ok else err).append(line)
    extra_failed = 0
    if unfinished_error is not None:
        missing = db.execute(
            "SELECT l.custom_id FROM lines l LEFT JOIN results r ON r.batch_id=l.batch_id AND r.line_no=l.line_no "
            "WHERE l.batch_id=? AND r.line_no IS NULL ORDER BY l.line_no", (batch_id,)).fetchall()
        for (custom_id,) in missing:
            err.append(json.dumps({"id": new_id("batch_req_"), "custom_id": custom_id, "response": None,
                                   "error": unfinished_error}))
        extra_failed = len(missing)
    now = int(time.time())
    file_ids: dict[str, str | None] = {"output_file_id": None, "error_file_id": None}
    for key, lines, name in (("output_file_id", out, "output"), ("error_file_id", err, "error")):
        if not lines:
            continue
        content = ("\n".join(lines) + "\n").encode()
        fid = new_id("file-")
        db.execute("INSERT INTO files (id, bytes, created_at, filename, purpose, content) VALUES (?,?,?,?,?,?)",
                   (fid, len(content), now, f"{batch_id}_{name}.jsonl", "batch_output", content))
        file_ids[key] = fid
    db.execute("UPDATE batches SET output_file_id=?, error_file_id=?, failed=failed+? WHERE id=?",
               (file_ids["output_file_id"], file_ids["error_file_id"], extra_failed, batch_id))
    return _set_status(db, batch_id, status, None, now)


def _batch_from_row(row: tuple) -> BatchRecord:
    data = dict(zip(_BATCH_COLUMNS, row))
    for key in ("metadata", "errors"):
        if data[key] is not None:
            data[key] = json.loads(data[key])
    return BatchRecord(**data)


def _page_size(db: sqlite3.Connection) -> int:
    return db.execute("PRAGMA page_size").fetchone()[0]


def _used_bytes(db: sqlite3.Connection) -> int:
    on_disk = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM files WHERE on_disk=1").fetchone()[0]
    return db.execute("PRAGMA page_count").fetchone()[0] * _page_size(db) + on_disk


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _os_error(path: Path, exc: OSError) -> StoreError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreError(f"the batch store {path} is full ({exc.strerror}): free disk space; "
                          f"nothing committed was lost")
    return StoreError(f"the batch store {path} failed: {exc}")


def _store_error(path: Path, exc: sqlite3.Error) -> StoreError:
    text = str(exc)
    if "full" in text:
        return StoreError(f"the batch store {path} is full ({text}): free disk space; nothing committed was lost")
    if isinstance(exc, sqlite3.DatabaseError) and ("malformed" in text or "not a database" in text):
        return StoreError(f"the batch store {path} is corrupt ({text}): restore it from a backup")
    return StoreError(f"the batch store {path} failed: {text}")
