"""The gather-race harness pieces that need no DeepSpeed."""
import numpy as np
import pytest

from fixes.entries.zero3_gathered_params_cpu_race import gathering
from fixes.entries.zero3_gathered_params_cpu_race.gathering import GatherRun, gather_job


def test_when_gather_job_is_made_then_it_is_zero3_built_partitioned_with_many_steps():
    job = gather_job(steps=7)
    assert (job.zero_stage, job.zero3_init, job.steps) == (3, True, 7)
    assert job.config["zero_optimization"]["stage3_param_persistence_threshold"] == 0


def test_when_a_run_has_corrupt_steps_then_it_counts_and_says_them():
    run = GatherRun(1, 200, (3, 40), 2.5, 1, {"w": np.zeros(1)})
    assert run.corrupt == 2
    assert str(run).startswith("rank 1: 2 of 200 all-at-once gathers differed") and "NaN/inf in 1" in str(run)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: gathering.run_gather_race(gather_job(), world_size=1), "at least 2 ranks"),
    (lambda: gathering.run_until_corrupt(gather_job(), attempts=0), "at least 1"),
])
def test_when_one_rank_or_no_attempt_is_asked_for_then_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize(("found", "attempts", "tried"), [
    ([0, 2, 0], 3, 2),  # stops at the first attempt with a corrupt gather
    ([0, 0, 0], 3, 3),  # none: every attempt is made
    ([5], 1, 1),
])
def test_when_the_race_shows_then_no_further_attempt_is_made(monkeypatch, found, attempts, tried):
    def gather_run(corrupt: int) -> GatherRun:
        return GatherRun(0, 10, tuple(range(corrupt)), 1.0 if corrupt else 0.0, 0, {})

    results = iter(found)
    monkeypatch.setattr(gathering, "run_gather_race", lambda job, world_size, timeout: [gather_run(next(results)), gather_run(0)])
    runs = gathering.run_until_corrupt(gather_job(), attempts=attempts)
    assert [run[0].corrupt for run in runs] == found[:tried]
