"""The step channel between the engine and a tensor-parallel rank, with the
rank's end in a real child process: answers in order, a step that raises
answers with its exception and the rank serves on, a rank that dies or
hangs ends the engine's wait (at once, or at the timeout), and nobody but
the first engine to connect can reach the rank."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import stat
import tempfile
import time

import pytest

from fluidserve.engine.executor.step_channel import (MAX_SOCKET_PATH, RankError, StepLink, StepListener, gather,
                                                     pack)

pytestmark = pytest.mark.timeout(60)


def _handle(request):
    kind, value = request
    if kind == "raise":
        raise ValueError(f"bad step {value}")
    if kind == "sleep":
        time.sleep(value)
    if kind == "unpicklable":
        return lambda: value
    if kind == "exit":
        time.sleep(value)
        os._exit(3)
    return {"echo": value, "pid": os.getpid()}


def _rank(paths) -> None:
    listener = StepListener()
    paths.put(listener.path)
    listener.serve(_handle)


@pytest.fixture
def ranks():
    """Start n ranks in child processes; yields a function returning their links and processes."""
    ctx = multiprocessing.get_context("spawn")
    started = []

    def start(n: int):
        paths = ctx.Queue()
        procs = [ctx.Process(target=_rank, args=(paths,), daemon=True) for _ in range(n)]
        for p in procs:
            p.start()
        links = [StepLink(paths.get(timeout=30)) for _ in procs]
        started.extend(procs)
        # Queue order is arrival order: pair each link with the process that answers on it.
        for link in links:
            link.send_packed(pack(("echo", None)))
        pids = [r["pid"] for r in gather(links, 10)]
        by_pid = {p.pid: p for p in procs}
        return links, [by_pid[pid] for pid in pids]

    yield start
    for p in started:
        if p.is_alive():
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
        p.join(5)


def test_answers_come_back_in_rank_order_step_after_step(ranks):
    links, _ = ranks(2)
    for step in range(50):
        for rank, link in enumerate(links):
            link.send_packed(pack(("echo", (step, rank, list(range(step))))))
        answers = gather(links, 10)
        assert [a["echo"] for a in answers] == [(step, r, list(range(step))) for r in range(2)]


def test_a_large_input_arrives_whole(ranks):
    (link,), _ = ranks(1)
    big = bytes(range(256)) * 40_000  # 10 MB: many socket reads
    link.send_packed(pack(("echo", big)))
    assert gather([link], 30)[0]["echo"] == big


def test_a_step_that_raises_names_the_rank_and_the_rank_serves_on(ranks):
    links, _ = ranks(2)
    links[0].send_packed(pack(("echo", 1)))
    links[1].send_packed(pack(("raise", 7)))
    with pytest.raises(RankError) as err:
        gather(links, 10)
    assert (err.value.rank, err.value.kind, err.value.detail) == (1, "failed", "ValueError: bad step 7")
    links[1].send_packed(pack(("echo", 2)))
    assert gather([links[1]], 10)[0]["echo"] == 2


def test_a_result_that_cannot_be_pickled_fails_its_step_and_the_rank_serves_on(ranks):
    (link,), _ = ranks(1)
    link.send_packed(pack(("unpicklable", 1)))
    with pytest.raises(RankError) as err:
        gather([link], 10)
    assert err.value.kind == "failed" and "pickle" in err.value.detail
    link.send_packed(pack(("echo", 2)))
    assert gather([link], 10)[0]["echo"] == 2


def test_a_rank_that_dies_ends_the_wait_at_once_while_another_still_works(ranks):
    links, procs = ranks(2)
    links[0].send_packed(pack(("sleep", 30)))  # rank 0 busy (say, in a collective waiting for rank 1)
    links[1].send_packed(pack(("echo", 0)))
    assert gather([links[1]], 10)[0]["echo"] == 0
    links[1].send_packed(pack(("sleep", 30)))
    started = time.monotonic()
    procs[1].kill()
    with pytest.raises(RankError) as err:
        gather(links, 20)
    assert time.monotonic() - started < 5
    assert (err.value.rank, err.value.kind) == (1, "closed")


def test_a_rank_that_exits_mid_step_is_closed_not_hung(ranks):
    (link,), _ = ranks(1)
    link.send_packed(pack(("exit", 0)))
    with pytest.raises(RankError) as err:
        gather([link], 10)
    assert err.value.kind == "closed"


def test_a_rank_failing_as_its_peer_dies_reports_the_dead_peer(ranks):
    """A collective fails on the ranks that survive a dead one: the death,
    not the failed collective it caused, is the error to report."""
    links, _ = ranks(2)
    links[0].send_packed(pack(("raise", "the peer hung up")))
    links[1].send_packed(pack(("exit", 0.1)))
    with pytest.raises(RankError) as err:
        gather(links, 10)
    assert (err.value.rank, err.value.kind) == (1, "closed")


def test_a_stopped_rank_is_hung_at_the_timeout(ranks):
    links, procs = ranks(2)
    os.kill(procs[1].pid, signal.SIGSTOP)
    for link in links:
        link.send_packed(pack(("echo", 0)))
    started = time.monotonic()
    with pytest.raises(RankError) as err:
        gather(links, 0.5)
    assert 0.5 <= time.monotonic() - started < 3
    assert (err.value.rank, err.value.kind) == (1, "hung")


def test_a_stopped_rank_cannot_hold_up_the_sending_of_a_large_step(ranks):
    """Its socket's buffer fills and stays full: the send gives up at its
    timeout, which the executor takes for a hung rank."""
    (link,), procs = ranks(1)
    os.kill(procs[0].pid, signal.SIGSTOP)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        link.send_packed(pack(("echo", bytes(20_000_000))), 0.5)
    assert 0.5 <= time.monotonic() - started < 3


def test_only_the_first_engine_reaches_the_rank():
    listener = StepListener()
    try:  # nobody else can even reach the socket's name
        assert stat.S_IMODE(os.stat(os.path.dirname(listener.path)).st_mode) == 0o700
    finally:
        listener.close()
    ctx = multiprocessing.get_context("spawn")
    paths = ctx.Queue()
    proc = ctx.Process(target=_rank, args=(paths,), daemon=True)
    proc.start()
    try:
        path = paths.get(timeout=30)
        link = StepLink(path)
        link.send_packed(pack(("echo", 1)))
        assert gather([link], 10)[0]["echo"] == 1
        assert not os.path.exists(path)  # the name is gone once the engine is in
        with pytest.raises(OSError), socket.socket(socket.AF_UNIX) as other:
            other.connect(path)
        link.close()
        proc.join(10)
        assert proc.exitcode == 0  # the engine closing its end ends the rank's serving
    finally:
        proc.kill()


def test_a_temporary_directory_too_deep_for_a_socket_falls_back_to_tmp(tmp_path, monkeypatch):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    listener = StepListener()
    try:
        assert listener.path.startswith("/tmp/fluidserve-step-") and len(listener.path) <= MAX_SOCKET_PATH
        assert stat.S_IMODE(os.stat(os.path.dirname(listener.path)).st_mode) == 0o700
        assert not any(deep.iterdir())  # the directory made there first is gone
    finally:
        listener.close()
