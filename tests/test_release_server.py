"""The check server behind ``tests.helpers.call_in_release``: each check is a fresh fork of a process that
imported torch and DeepSpeed, sees the caller's environment of the moment, and a failure or a hang
comes back as a failed test with the check's own output."""
import os
import time

import pytest

from ci import releases
from tests.helpers import call_in_release

MARK = "fixbook-server-check"


def check_deepspeed_is_imported_and_left_untouched():
    import sys

    import deepspeed

    assert "torch" in sys.modules and "deepspeed" in sys.modules
    assert not hasattr(deepspeed, "_fixbook_server_check"), "a previous check's change leaked into this one"
    deepspeed._fixbook_server_check = True  # the next check must not see this


def check_environment_is_the_callers_now():
    assert os.environ["FIXBOOK_SERVER_CHECK"] == "set by the test"
    assert os.environ["FIXBOOK_DEEPSPEED_RELEASE"] == releases.load().newest
    assert os.getcwd() == str(releases.ROOT)


def check_that_raises():
    print("printed before raising")
    raise AssertionError("the check's own message")


def check_that_hangs_with_a_child():
    import subprocess
    import sys

    subprocess.Popen([sys.executable, "-c", f"import time; time.sleep(600)  # {MARK}"])
    time.sleep(600)


def check_ranks_fork_from_a_forkserver_forked_from_this_check():
    import sys

    from multiprocessing import forkserver

    from fixes.harness import launch

    pid = forkserver._forkserver._forkserver_pid
    assert pid is not None, "no forkserver was forked for this check: its first launch spawns a new Python"
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    assert (int(fields[1]), int(fields[2])) == (os.getpid(), os.getpgrp()), "not this check's child, in its group"
    assert open(f"/proc/{pid}/cmdline", "rb").read() == open("/proc/self/cmdline", "rb").read(), \
        "the forkserver was spawned (a new command line), not forked from this check"
    assert "deepspeed" in sys.modules
    # the ranks are the forkserver's children, in this check's process group: a timeout that ends it ends them
    assert [int(v) for v in launch(os.getppid, 2, timeout=120)] == [pid, pid]
    assert [int(v) for v in launch(os.getpgrp, 2, timeout=120)] == [os.getpgrp()] * 2


def _alive_with_mark() -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if MARK.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                found.append(int(pid))
        except OSError:
            pass
    return found


def test_when_two_checks_run_then_each_is_a_fresh_process_with_deepspeed_imported():
    newest = releases.load().newest
    call_in_release(newest, check_deepspeed_is_imported_and_left_untouched)
    call_in_release(newest, check_deepspeed_is_imported_and_left_untouched)


def test_when_environment_changes_after_the_server_started_then_the_check_sees_it(monkeypatch):
    newest = releases.load().newest
    call_in_release(newest, check_deepspeed_is_imported_and_left_untouched)  # the server is running now
    monkeypatch.setenv("FIXBOOK_SERVER_CHECK", "set by the test")
    call_in_release(newest, check_environment_is_the_callers_now)


def test_when_a_check_launches_ranks_then_they_fork_from_its_own_forkserver_without_a_new_python():
    call_in_release(releases.load().newest, check_ranks_fork_from_a_forkserver_forked_from_this_check)


def test_when_a_check_raises_then_the_test_fails_with_its_output_and_traceback():
    with pytest.raises(pytest.fail.Exception) as failed:
        call_in_release(releases.load().newest, check_that_raises)
    message = str(failed.value)
    assert "check_that_raises under DeepSpeed" in message and "(exit 1)" in message
    assert "printed before raising" in message and "AssertionError: the check's own message" in message


def test_when_a_check_hangs_then_it_and_what_it_started_are_killed_at_the_timeout():
    newest = releases.load().newest
    call_in_release(newest, check_deepspeed_is_imported_and_left_untouched)  # server start not in the timeout
    started = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match="ran past its 5 s timeout and was killed"):
        call_in_release(newest, check_that_hangs_with_a_child, timeout=5)
    assert time.monotonic() - started < 60
    deadline = time.monotonic() + 10
    while _alive_with_mark() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive_with_mark() == [], "the hanging check's child outlived the timeout"
    call_in_release(newest, check_deepspeed_is_imported_and_left_untouched)  # the server still serves


def test_when_server_is_off_then_a_new_python_runs_the_check_the_same_way(monkeypatch):
    monkeypatch.setenv("FIXBOOK_CHECK_SERVER", "0")
    monkeypatch.setenv("FIXBOOK_SERVER_CHECK", "set by the test")
    call_in_release(releases.load().newest, check_environment_is_the_callers_now)
    with pytest.raises(pytest.fail.Exception, match="AssertionError: the check's own message"):
        call_in_release(releases.load().newest, check_that_raises)
