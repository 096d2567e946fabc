"""The record of a user's script next to its plain-PyTorch reference. The launched checks run under the newest
installed DeepSpeed, in a child process (see tests/helpers.py)."""
import numpy as np

from ci import releases
from fixes.harness import Job, ScriptOutcome, train_reference
from tests.helpers import call_in_release


def check_a_script_that_trains_like_its_reference_matches():
    from fixes.harness import launch_script

    job = Job(steps=2)
    trained = train_reference(job)  # the rank's "script" (dict) hands back what a script that trains so returns
    outcome = ScriptOutcome("a run", job.dtype)
    result = launch_script(outcome, dict, [("params", trained.params), ("losses", trained.losses), ("extra", 7)],
                           timeout=120)
    assert result is not None and result["extra"] == 7, outcome.error
    outcome.set_reference(train_reference(job))
    assert outcome.matches and outcome.max_abs_diff == 0.0 and outcome.error_line == ""
    assert [c.name for c in outcome.comparisons()] == ["a run, float32: weights", "a run, float32: losses"]


def check_a_raising_rank_is_kept_as_one_line():
    import json

    from fixes.exceptions import RankFailedError
    from fixes.harness import launch_script

    outcome = ScriptOutcome("a run", "float32")
    assert launch_script(outcome, json.loads, "{not json\nsecond line", timeout=120) is None
    assert isinstance(outcome.error, RankFailedError) and "\n" not in outcome.error_line
    assert outcome.error_line.startswith("JSONDecodeError: ") and not outcome.matches


def test_when_the_script_trains_like_its_reference_then_the_outcome_matches():
    call_in_release(releases.load().newest, check_a_script_that_trains_like_its_reference_matches)


def test_when_the_rank_raises_then_the_error_is_kept_as_one_line_and_nothing_matches():
    call_in_release(releases.load().newest, check_a_raising_rank_is_kept_as_one_line)


def test_when_the_weights_differ_then_the_outcome_does_not_match():
    job = Job(steps=2)
    reference = train_reference(job)
    outcome = ScriptOutcome("a run", job.dtype, params={k: v + 1e-2 for k, v in reference.params.items()},
                            losses=list(reference.losses))
    outcome.set_reference(reference)
    assert not outcome.matches and np.isclose(outcome.max_abs_diff, 1e-2)
