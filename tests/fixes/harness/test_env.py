"""The harness's process set-up helpers that need DeepSpeed, checked under the newest installed release in a child
process (see tests/helpers.py)."""
from ci import releases
from tests.helpers import call_in_release


def check_each_distinct_deepspeed_line_is_shown_once():
    import logging

    from deepspeed.utils import logger

    from fixes import harness

    seen: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    harness.fold_repeated_warnings()
    harness.fold_repeated_warnings()  # idempotent: one filter
    for message in ("untested optimizer", "untested optimizer", "another", "untested optimizer"):
        logger.warning(message)
    assert seen == ["untested optimizer (shown once: its repeats in this run are folded)",
                    "another (shown once: its repeats in this run are folded)"], seen


def test_when_a_warning_repeats_then_it_is_shown_once_and_marked_folded():
    call_in_release(releases.load().newest, check_each_distinct_deepspeed_line_is_shown_once)
