"""observe_ranks: what each rank did (finished, raised, or stuck and where) within a bound, never a hang; under the
newest installed DeepSpeed, in a child process."""
from ci import releases
from tests.helpers import call_in_release


def check_a_blocked_rank_is_recorded_as_stalled_with_its_stack():
    import time

    from fixes.entries.pipeline_nested_backward import reproduce as repro

    started = time.monotonic()
    outcomes = repro.observe_ranks(time.sleep, 2, 600, stall_s=3, timeout=60)
    assert time.monotonic() - started < 60
    assert [o.status for o in outcomes] == ["stalled", "stalled"], outcomes
    assert all(o.seconds is not None and o.seconds >= 3 for o in outcomes), outcomes
    assert "fn(*args)" in outcomes[0].where, outcomes[0].where  # the line it was blocked on


def check_raising_and_finishing_ranks_are_told_apart_and_frames_named():
    import math

    from fixes.entries.pipeline_nested_backward import reproduce as repro

    [raised] = repro.observe_ranks(math.sqrt, 1, -1.0, stall_s=3, timeout=60)
    assert raised.status == "raised" and raised.error == "ValueError: math domain error", raised
    [finished] = repro.observe_ranks(math.sqrt, 1, 4.0, stall_s=30, timeout=90)
    assert finished.status == "finished" and not finished.error and finished.result == 2.0, finished
    where = ('  File "/x/deepspeed/runtime/pipe/engine.py", line 1086, in _exec_send_grads\n'
             '  File "/x/deepspeed/runtime/pipe/p2p.py", line 60, in send\n'
             '  File "/v/torch/distributed/distributed_c10d.py", line 2753, in send\n')
    outcome = repro.RankOutcome(1, "stalled", 20.0, "", where)
    assert outcome.frames() == ["pipe/engine.py:_exec_send_grads", "pipe/p2p.py:send"], outcome.frames()
    assert outcome.frames("torch") == ["distributed/distributed_c10d.py:send"], outcome.frames("torch")


# Rank functions must be importable in the ranks: ``eval`` of one line, which raises on rank 0 and on rank 1 does what
# the rest says. Waiting: sleeping, as a rank blocked on the rank that raised waits. Computing: a loop on one line (the
# same Python stack at every look) that uses the CPU for a few seconds and then returns.
RAISE_THEN_WAIT = "1 / 0 if __import__('os').environ['RANK'] == '0' else __import__('time').sleep(600)"
RAISE_THEN_COMPUTE = ("1 / 0 if __import__('os').environ['RANK'] == '0' else "
                      "any(__import__('time').monotonic() > end for end in [__import__('time').monotonic() + 3] "
                      "for _ in iter(int, 1))")


def check_a_rank_waiting_after_its_peer_raised_is_recorded_as_stalled_before_stall_s():
    import time

    from fixes.entries.pipeline_nested_backward import reproduce as repro

    started = time.monotonic()
    raised, stalled = repro.observe_ranks(eval, 2, RAISE_THEN_WAIT, stall_s=100, timeout=150)
    assert time.monotonic() - started < 100
    assert raised.status == "raised" and raised.error.startswith("ZeroDivisionError"), raised
    assert stalled.status == "stalled" and "rank 0 raised" in stalled.why and stalled.seconds < 100, stalled
    assert "fn(*args)" in stalled.where, stalled.where  # the line it was blocked on


def check_a_rank_computing_after_its_peer_raised_is_not_called_stalled():
    from fixes.entries.pipeline_nested_backward import reproduce as repro

    raised, finished = repro.observe_ranks(eval, 2, RAISE_THEN_COMPUTE, stall_s=100, timeout=150)
    assert raised.status == "raised" and raised.error.startswith("ZeroDivisionError"), raised
    assert finished.status == "finished" and finished.seconds >= 3 and finished.result is True, finished


def test_when_a_rank_blocks_then_it_is_recorded_as_stalled_within_the_bound():
    call_in_release(releases.load().newest, check_a_blocked_rank_is_recorded_as_stalled_with_its_stack)


def test_when_ranks_raise_or_finish_then_outcomes_say_which_and_name_the_package_frames():
    call_in_release(releases.load().newest, check_raising_and_finishing_ranks_are_told_apart_and_frames_named)


def test_when_a_peer_raised_then_a_waiting_rank_is_stalled_early_and_a_computing_one_is_not():
    call_in_release(releases.load().newest, check_a_rank_waiting_after_its_peer_raised_is_recorded_as_stalled_before_stall_s)
    call_in_release(releases.load().newest, check_a_rank_computing_after_its_peer_raised_is_not_called_stalled)
