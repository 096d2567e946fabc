"""gradient-clipping-default-1 on 0.19.3, the first release with the new default: ``fixes.apply()`` without ids skips
this behaviour change and says how to ask for it."""
import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.19.3"
FIX_ID = "gradient-clipping-default-1"


def check_apply_without_ids_skips_it_and_names_the_call():
    import warnings

    from fixes.entries.gradient_clipping_default_1 import _TARGET

    harness.setup()
    config = _TARGET.owner_and_name()[0]
    original = vars(config)["get_gradient_clipping"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fixes.FixbookWarning)  # another entry's refusal is not under test
        outcome = {o.fix_id: o for o in fixes.apply()}[FIX_ID]
    assert outcome.action == "skipped" and "not a bug" in outcome.message, outcome
    assert f"fixes.apply({FIX_ID!r})" in outcome.message, outcome
    assert vars(config)["get_gradient_clipping"] is original and not fixes.get(FIX_ID).applied
    assert config.get_gradient_clipping({}) == 1.0
    fixes.revert()


def test_when_apply_is_called_without_ids_then_the_behaviour_change_is_skipped():
    call_in_release(AFFECTED, check_apply_without_ids_skips_it_and_names_the_call)
