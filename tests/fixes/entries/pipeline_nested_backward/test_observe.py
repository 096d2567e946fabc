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
    assert finished.status == "finished" and not finished.error, finished
    where = ('  File "/x/deepspeed/runtime/pipe/engine.py", line 1086, in _exec_send_grads\n'
             '  File "/x/deepspeed/runtime/pipe/p2p.py", line 60, in send\n'
             '  File "/v/torch/distributed/distributed_c10d.py", line 2753, in send\n')
    outcome = repro.RankOutcome(1, "stalled", 20.0, "", where)
    assert outcome.frames() == ["pipe/engine.py:_exec_send_grads", "pipe/p2p.py:send"], outcome.frames()
    assert outcome.frames("torch") == ["distributed/distributed_c10d.py:send"], outcome.frames("torch")


def test_when_a_rank_blocks_then_it_is_recorded_as_stalled_within_the_bound():
    call_in_release(releases.load().newest, check_a_blocked_rank_is_recorded_as_stalled_with_its_stack)


def test_when_ranks_raise_or_finish_then_outcomes_say_which_and_name_the_package_frames():
    call_in_release(releases.load().newest, check_raising_and_finishing_ranks_are_told_apart_and_frames_named)
