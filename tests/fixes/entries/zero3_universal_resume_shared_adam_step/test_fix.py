"""zero3-universal-resume-shared-adam-step beyond the contract and the notebook (0.19.8, fp32/bf16, one and two ranks):
before the loader rewrite (0.17.6) no universal checkpoint with several sub-groups converts, so reproduce() cannot tell."""
from tests.helpers import call_in_release


def check_release_before_the_loader_rewrite_cannot_tell():
    from fixes.entries.zero3_universal_resume_shared_adam_step.reproduce import reproduce
    from fixes.exceptions import CannotTellError
    from fixes.harness import setup

    setup()
    try:
        reproduce()
    except CannotTellError as exc:
        assert "exceeds dimension size" in str(exc), exc
    else:
        raise AssertionError("a universal checkpoint with several sub-groups was made before 0.18.0")


def test_when_release_predates_the_shared_step_then_reproduce_cannot_tell():
    call_in_release("0.17.6", check_release_before_the_loader_rewrite_cannot_tell)
