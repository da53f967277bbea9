"""The agent's link to its warden under back-pressure: a message waits, briefly, never drops in
silence.

Why: the warden is the only one that can fence a frozen agent's workers; a worker's pidfd lost
on a full socket (the warden descheduled under load) would be a worker nobody fences.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from etcdrun.agent.fencing import warden


@pytest.fixture
def stopped_link():
    link = warden.Link("test-link")
    os.kill(link.proc.pid, signal.SIGSTOP)  # it reads nothing now: the socket fills
    try:
        while True:  # fill it without the wait under test
            try:
                link.sock.send(b"T" + repr(time.monotonic() + 3600).encode() + b" 1e9")
            except BlockingIOError:
                break
        yield link
    finally:
        os.kill(link.proc.pid, signal.SIGCONT)
        link.close()


def test_a_full_socket_is_waited_on_until_the_warden_reads(stopped_link, caplog):
    timer = threading.Timer(0.15, os.kill, (stopped_link.proc.pid, signal.SIGCONT))
    timer.start()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING):
        stopped_link.new_attempt()
    took = time.monotonic() - t0
    timer.join()
    assert took > 0.1, took  # it waited for the thaw ...
    assert "not delivered" not in caplog.text  # ... and delivered


def test_a_warden_stuck_past_the_wait_is_said_once(stopped_link, caplog):
    with caplog.at_level(logging.WARNING):
        stopped_link.new_attempt()
        stopped_link.new_attempt()
    assert caplog.text.count("a message was not delivered") == 1, caplog.text
    assert "socket stayed full" in caplog.text


def test_a_warden_woken_past_its_deadline_reads_the_newer_one_before_it_fences():
    """Soak seed 1591: a whole node frozen, its agent thawed first and kept its lease alive, its
    warden thawed last, past the deadlines it held, and fenced a live lease's workers. Messages
    already sent must count before a deadline does.
    """
    import subprocess

    sleeper = subprocess.Popen(["sleep", "60"])
    link = warden.Link("test-drain")
    try:
        link.worker(os.pidfd_open(sleeper.pid))
        now = time.monotonic()
        link.deadline(now + 0.2, now + 0.3)
        os.kill(link.proc.pid, signal.SIGSTOP)
        while time.monotonic() < now + 0.5:  # past both while it is frozen (the schedule)
            time.sleep(0.05)
        kill_at = time.monotonic() + 0.5
        link.deadline(kill_at - 0.2, kill_at)  # what the thawed agent sent meanwhile
        os.kill(link.proc.pid, signal.SIGCONT)
        link.sock.setblocking(True)
        link.sock.settimeout(10)
        assert link.sock.recv(16) == warden.FENCED  # the newer deadline's fence, in time ...
        assert time.monotonic() >= kill_at, "it fenced on the deadline it held when frozen"
        assert sleeper.wait(5) == -signal.SIGKILL  # ... and then it did kill
    finally:
        os.kill(link.proc.pid, signal.SIGCONT)
        sleeper.kill()
        sleeper.wait()
        link.close()
