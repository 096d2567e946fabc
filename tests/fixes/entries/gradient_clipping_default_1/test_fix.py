"""gradient-clipping-default-1 (a behaviour change) on the release that introduced the new default and on a
release with the old one, in child processes."""
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.19.3"  # the first release with GRADIENT_CLIPPING_DEFAULT = 1.0
OLD_DEFAULT = "0.19.1"  # GRADIENT_CLIPPING_DEFAULT = 0. (a release the test run installs; 0.19.2 is not one)
FIX_ID = "gradient-clipping-default-1"


def _owner():
    from fixes.harness import setup

    setup()
    from fixes.entries.gradient_clipping_default_1 import _TARGET

    return _TARGET.owner_and_name()[0]


def get_gradient_clipping(param_dict):
    """A drifted get_gradient_clipping (the default inlined) that still has the new default."""
    return param_dict.get("gradient_clipping", 1.0)


def check_reproduces_then_the_fix_pins_the_old_default():
    import fixes
    from fixes.entries.gradient_clipping_default_1.reproduce import reproduce

    config = _owner()
    assert config.get_gradient_clipping({}) == 1.0
    assert reproduce() is True
    fixes.apply(FIX_ID)
    assert config.get_gradient_clipping({}) == 0.0
    assert reproduce() is False
    fixes.revert(FIX_ID)
    assert config.get_gradient_clipping({}) == 1.0
    assert reproduce() is True


def check_an_explicit_gradient_clipping_is_kept_with_the_fix():
    import fixes
    from fixes import harness
    from fixes.entries.gradient_clipping_default_1 import reproduce as entry

    _owner()
    fixes.apply(FIX_ID)
    for value in (1.0, 0.0, 0.5):
        run = entry.job(zero_stage=2)
        engine, trained = entry.train_user_job(run, entry.user_config(run, gradient_clipping=value))
        assert engine.gradient_clipping() == value, (value, engine.gradient_clipping())
        reference = entry.train_reference_clipped(run, value)
        harness.assert_close(trained.params, reference.params, "float32", f"explicit gradient_clipping={value}")
    fixes.revert(FIX_ID)


def check_apply_without_ids_skips_it_and_names_the_call():
    import warnings

    import fixes

    config = _owner()
    original = vars(config)["get_gradient_clipping"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fixes.FixbookWarning)  # another entry's refusal is not under test
        outcomes = {o.fix_id: o for o in fixes.apply()}
    outcome = outcomes[FIX_ID]
    assert outcome.action == "skipped" and "not a bug" in outcome.message, outcome
    assert f"fixes.apply({FIX_ID!r})" in outcome.message, outcome
    assert vars(config)["get_gradient_clipping"] is original and not fixes.get(FIX_ID).applied
    assert config.get_gradient_clipping({}) == 1.0
    fixes.revert()


def check_drifted_target_raises_and_patches_nothing():
    from fixes.entries.gradient_clipping_default_1 import _TARGET

    owner, name = _TARGET.owner_and_name()
    assert_drift_refused(FIX_ID, owner, name, get_gradient_clipping)


def check_old_default_release_is_a_noop():
    from fixes.entries.gradient_clipping_default_1.reproduce import reproduce

    config = _owner()
    assert config.get_gradient_clipping({}) == 0.0
    assert_noop_on_fixed_release(FIX_ID, config)
    assert reproduce() is False


def test_when_applied_then_a_config_without_the_key_no_longer_clips_and_does_again_after_revert():
    call_in_release(AFFECTED, check_reproduces_then_the_fix_pins_the_old_default)


def test_when_applied_and_the_config_sets_gradient_clipping_then_that_value_is_kept():
    call_in_release(AFFECTED, check_an_explicit_gradient_clipping_is_kept_with_the_fix)


def test_when_apply_is_called_without_ids_then_the_behaviour_change_is_skipped():
    call_in_release(AFFECTED, check_apply_without_ids_skips_it_and_names_the_call)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_has_the_old_default_then_apply_is_a_noop():
    call_in_release(OLD_DEFAULT, check_old_default_release_is_a_noop)
