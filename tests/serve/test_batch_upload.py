"""``POST /v1/files`` end to end with a real uvicorn server: a 150 MB
upload goes to the data dir in chunks (peak memory measured), a refused
upload leaves nothing behind, accepted files survive a restart, and a batch
input is validated line by line from disk."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Callable

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fluidserve.serve.batches import parse_batch_input
from fluidserve.serve.store import DB_NAME, FILES_DIR, Store
from test_batches import completion_line, start_batch_server, wait_batch

pytestmark = pytest.mark.timeout(180)

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def upload_server(tiny_model, tmp_path_factory):
    data = tmp_path_factory.mktemp("upload-data")
    srv = start_batch_server(tiny_model("llama"), data)
    srv.extra["data_dir"] = data
    yield srv
    srv.stop()


def write_jsonl(path: Path, target_bytes: int, pad_chars: int, bad_line: int | None = None) -> tuple[int, str]:
    """Valid request lines up to ``target_bytes`` (line ``bad_line`` is not
    JSON); returns (number of lines, sha256 of the file)."""
    digest = hashlib.sha256()
    pad = "p" * pad_chars
    n = size = 0
    with open(path, "wb") as f:
        while size < target_bytes:
            n += 1
            if n == bad_line:
                row = b'{"custom_id": "broken", "method": "POST",\n'
            else:
                row = (json.dumps(completion_line(f"r{n}", pad, max_tokens=1)) + "\n").encode()
            f.write(row)
            digest.update(row)
            size += len(row)
    return n, digest.hexdigest()


def _status_bytes(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def peak_rss_growth(fn: Callable[[], object]) -> tuple[object, int]:
    """``fn()`` and how far this process's resident memory rose above where
    it stood at the start, at its highest during the call. The server runs in
    a thread of this process, so this bounds the server and the client
    together."""
    if not Path("/proc/self/status").exists():
        pytest.skip("needs Linux /proc to read resident memory")
    try:
        # Resets VmHWM to the current RSS: the peak then covers this call only,
        # not whatever an earlier test in this process allocated.
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return _sampled_peak_growth(fn)
    start = _status_bytes("VmHWM")
    out = fn()
    return out, _status_bytes("VmHWM") - start


def _sampled_peak_growth(fn: Callable[[], object]) -> tuple[object, int]:
    start = _status_bytes("VmRSS")
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _status_bytes("VmRSS"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out = fn()
    finally:
        done.set()
        sampler.join()
    return out, peak[0] - start


def files_on_disk(data_dir: Path) -> list[str]:
    return sorted(p.name for p in (data_dir / FILES_DIR).iterdir())


def multipart_body(boundary: str, content: bytes, filename: str = "in.jsonl", purpose: str = "batch") -> bytes:
    return (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\n{purpose}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n").encode() + content + f"\r\n--{boundary}--\r\n".encode()


def test_150mb_upload_is_streamed_to_disk(upload_server, tmp_path):
    path = tmp_path / "big.jsonl"
    n, digest = write_jsonl(path, 150 * MiB, pad_chars=3200)
    size = path.stat().st_size
    assert n <= 50_000  # a batch the server would accept

    def upload() -> httpx.Response:
        with open(path, "rb") as f:  # httpx sends a file object in chunks, never whole
            return httpx.post(upload_server.base_url + "/v1/files", data={"purpose": "batch"},
                              files={"file": ("big.jsonl", f, "application/jsonl")}, timeout=120)

    r, growth = peak_rss_growth(upload)
    assert r.status_code == 200, r.text
    rec = r.json()
    assert (rec["bytes"], rec["filename"], rec["purpose"]) == (size, "big.jsonl", "batch")
    assert growth < 50 * MiB, f"peak RSS rose {growth / MiB:.0f} MiB during a {size / MiB:.0f} MiB upload"
    assert rec["id"] in files_on_disk(upload_server.extra["data_dir"])

    def download() -> tuple[int, str]:
        got, h = 0, hashlib.sha256()
        with httpx.stream("GET", f"{upload_server.base_url}/v1/files/{rec['id']}/content", timeout=120) as resp:
            assert resp.status_code == 200
            assert int(resp.headers["content-length"]) == size
            for chunk in resp.iter_bytes():
                got += len(chunk)
                h.update(chunk)
        return got, h.hexdigest()

    (got, got_digest), growth = peak_rss_growth(download)
    assert (got, got_digest) == (size, digest)
    assert growth < 50 * MiB, f"peak RSS rose {growth / MiB:.0f} MiB while sending a {size / MiB:.0f} MiB file"

    c = openai.OpenAI(base_url=upload_server.base_url + "/v1", api_key="x", max_retries=0)
    assert c.files.delete(rec["id"]).deleted
    assert rec["id"] not in files_on_disk(upload_server.extra["data_dir"])


def test_invalid_line_mid_file_fails_the_batch_and_stores_no_lines(upload_server, tmp_path):
    path = tmp_path / "mid.jsonl"
    n, _ = write_jsonl(path, 16 * MiB, pad_chars=1600, bad_line=5001)
    c = openai.OpenAI(base_url=upload_server.base_url + "/v1", api_key="x", max_retries=0)
    with open(path, "rb") as f:
        up = c.files.create(file=f, purpose="batch")
    assert up.bytes == path.stat().st_size
    b = wait_batch(c, c.batches.create(input_file_id=up.id, endpoint="/v1/completions", completion_window="24h").id)
    assert b.status == "failed" and b.request_counts.total == 0
    # The unterminated object is line 5001; the line after it is whole again.
    assert [(e.line, e.code) for e in b.errors.data] == [(5001, "invalid_json_line")]
    data_dir = upload_server.extra["data_dir"]
    with sqlite3.connect(data_dir / DB_NAME) as db:
        assert db.execute("SELECT COUNT(*) FROM lines WHERE batch_id=?", (b.id,)).fetchone()[0] == 0
    assert c.files.delete(up.id).deleted
    assert up.id not in files_on_disk(data_dir)


def test_refused_uploads_leave_no_file_and_no_row(tiny_model, tmp_path):
    # The store may hold 512 KiB (database and files together); a file may be 1 MiB.
    srv = start_batch_server(tiny_model("llama"), tmp_path, max_file_bytes=MiB, store_max_pages=128)
    url = srv.base_url + "/v1/files"
    form = {"Content-Type": "multipart/form-data; boundary=XyZ"}

    def refused(status: int, param: str, code: str | None = None, **kwargs) -> None:
        r = httpx.post(url, timeout=30, **kwargs)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["param"] == param and (code is None or err["code"] == code), err
        assert files_on_disk(tmp_path) == []
        assert httpx.get(url, timeout=30).json()["data"] == []

    try:
        # over the store's room: fails while being copied into the data dir
        refused(507, None, "storage_full", content=multipart_body("XyZ", b"a" * 600_000), headers=form)
        # over max_file_bytes, within the body limit: refused before any copy
        refused(413, "file", "file_too_large", content=multipart_body("XyZ", b"b" * (MiB + 1)), headers=form)

        def chunked():  # no Content-Length: the limit holds while the body streams in
            body = multipart_body("XyZ", b"c" * (MiB + 200_000))
            for i in range(0, len(body), 64 * 1024):
                yield body[i:i + 64 * 1024]

        refused(413, "file", "file_too_large", content=chunked(), headers=form)
        cut = multipart_body("XyZ", b'{"custom_id": "x"}\n')[:-10]  # the closing boundary never came
        refused(400, "file", content=cut, headers=form)
        refused(400, "file", content=b"", headers=form)
        refused(400, "file", content=multipart_body("XyZ", b"{}"),
                headers={"Content-Type": "multipart/form-data"})  # no boundary
        refused(400, "purpose", content=multipart_body("XyZ", b"{}", purpose="fine-tune"), headers=form)

        ok = httpx.post(url, content=multipart_body("XyZ", b"d" * 100_000), headers=form, timeout=30)
        assert ok.status_code == 200, ok.text
        assert files_on_disk(tmp_path) == [ok.json()["id"]]
        with sqlite3.connect(tmp_path / DB_NAME) as db:
            assert db.execute("SELECT id FROM files").fetchall() == [(ok.json()["id"],)]
    finally:
        srv.stop()


def test_restart_keeps_accepted_files_and_drops_unfinished_ones(tiny_model, tmp_path):
    content = b"".join((json.dumps(completion_line(f"k{i}", "kept")) + "\n").encode() for i in range(100))
    srv = start_batch_server(tiny_model("llama"), tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        kept = c.files.create(file=("kept.jsonl", content), purpose="batch")
    finally:
        srv.stop()
    # What a crash mid-upload leaves: a partial copy, and a complete one whose row never committed.
    (tmp_path / FILES_DIR / "file-0123.tmp").write_bytes(b"partial")
    (tmp_path / FILES_DIR / "file-4567").write_bytes(content)
    srv = start_batch_server(tiny_model("llama"), tmp_path)
    try:
        c = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0)
        assert c.files.retrieve(kept.id).bytes == len(content)
        assert c.files.content(kept.id).content == content
        assert files_on_disk(tmp_path) == [kept.id]
        b = wait_batch(c, c.batches.create(input_file_id=kept.id, endpoint="/v1/completions",
                                           completion_window="24h").id, statuses=("in_progress", "completed"))
        assert b.request_counts.total == 100
        try:  # no need to run the rest
            wait_batch(c, c.batches.cancel(b.id).id)
        except openai.ConflictError:  # it completed first
            pass
    finally:
        srv.stop()


def test_store_reads_files_kept_in_the_database(tmp_path):
    # A store written before uploads went to disk holds content in the row.
    with sqlite3.connect(tmp_path / DB_NAME) as db:
        db.execute("CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, "
                   "bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, filename TEXT NOT NULL, "
                   "purpose TEXT NOT NULL, content BLOB NOT NULL)")
        db.execute("INSERT INTO files (id, bytes, created_at, filename, purpose, content) "
                   "VALUES ('file-old', 3, 1, 'old.jsonl', 'batch', x'7b7d0a')")
    store = Store(tmp_path)
    with store.open_file("file-old") as f:
        assert f.read() == b"{}\n"
    new = store.create_file("new.jsonl", "batch", b"new\n")
    assert [r.id for r in store.list_files(after=None, limit=10, order="asc", purpose=None).items] == \
        ["file-old", new.id]
    assert store.delete_file("file-old") and store.open_file("file-old") is None
    assert store.delete_file(new.id) and files_on_disk(tmp_path) == []
    store.close()


_BREAKS = ["\n", "\r\n", "\r", "\x0b", "\x0c", "\x1c", "\x85", "\u2028", "\n\n", " \n"]
_LINES = [json.dumps(completion_line("a", "x")), json.dumps(completion_line("b", "é")), "{not json", "[]", "  "]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_LINES), st.sampled_from(_BREAKS)), max_size=12))
def test_streamed_line_numbers_match_the_whole_text(parts):
    # The file is read a b"\n"-terminated piece at a time; numbering must be
    # that of str.splitlines over the whole decoded text, as OpenAI counts.
    content = "".join(line + brk for line, brk in parts).encode()
    lines, errors = parse_batch_input(content, "/v1/completions", 10_000)
    numbered = [no for no, raw in enumerate(content.decode().splitlines(), start=1) if raw.strip()]
    got = sorted([ln.line_no for ln in lines] + [e["line"] for e in errors if e["line"] is not None])
    assert got == numbered


def test_invalid_utf8_after_valid_lines_is_a_file_error():
    content = (json.dumps(completion_line("a", "x")) + "\n{not json\n").encode() + b'{"x": "\xe2\x82"}\n'
    try:
        content.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = exc.reason
    lines, errors = parse_batch_input(content, "/v1/completions", 10)
    assert lines == [] and errors == [{"code": "invalid_file_encoding", "param": None, "line": None,
                                       "message": f"The input file is not UTF-8 ({reason})."}]
