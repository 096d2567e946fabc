"""autotp-partition-config-path on its affected release (0.18.8), the first release measured fixed (0.18.9), a release
without custom partition patterns (0.18.5) and the newest, in child processes; the ranks are two gloo processes."""
from ci import releases
from tests.helpers import assert_drift_refused, assert_noop_on_fixed_release, call_in_release

AFFECTED = "0.18.8"
FIRST_FIXED = "0.18.9"
WITHOUT_PATTERNS = "0.18.5"
FIX_ID = "autotp-partition-config-path"
UNSHARDED_NAMES = ["mlp.up_proj", "mlp.down_proj"] * 2
FULL_NAMES = ["layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj"]


def _auto_tp():
    from fixes.harness import setup

    setup()
    from deepspeed.module_inject.auto_tp import AutoTP

    return AutoTP


def _names_matched(partition_config):
    """The name ``AutoTP._replace_module`` gives each layer it matches patterns against (its
    ``_replace_with_config`` replaced on the instance by a recorder), on the entry's model; with
    ``partition_config`` None, the names AutoTP's own ``linear_policies`` path gets."""
    import torch

    from fixes.entries.autotp_partition_config_path.autotp import TinyDecoder

    auto_tp = _auto_tp()
    names = []
    autotp = auto_tp(module=TinyDecoder(), all_reduce_linears=(), prefix="", state_dict=None,
                     linear_layer_setting=(torch.nn.Linear, torch.nn.Embedding), orig_layer_impl=None,
                     partition_config=partition_config)
    autotp._replace_with_config = lambda child, name: names.append(name)
    autotp.linear_policies = {torch.nn.Linear: lambda child, name, conv: names.append(name) or child}
    autotp._replace_module(autotp.module)
    return names


def _partition_config():
    from deepspeed.module_inject.autotp_config import AutoTPConfig

    from fixes.entries.autotp_partition_config_path.autotp import PARTITION_CONFIG

    return AutoTPConfig.from_dict(PARTITION_CONFIG)


def check_the_patterns_see_the_whole_path_only_with_the_fix():
    import fixes

    _auto_tp()
    config = _partition_config()
    assert _names_matched(config) == UNSHARDED_NAMES
    traditional = _names_matched(None)
    fixes.apply(FIX_ID)
    try:
        assert _names_matched(config) == FULL_NAMES
        assert _names_matched(None) == traditional  # AutoTP's own linear_policies path is left alone
    finally:
        fixes.revert(FIX_ID)
    assert _names_matched(config) == UNSHARDED_NAMES


def check_with_the_fix_the_ranks_hold_their_shards_and_train_like_plain_pytorch():
    import numpy as np

    from fixes import harness
    from fixes.entries.autotp_partition_config_path import autotp

    _auto_tp()
    broken = autotp.run(autotp.autotp_job())
    assert broken.unsharded == sorted(broken.full), broken.unsharded
    harness.assert_differs(broken.elements_per_rank(), broken.configured_elements(), "float32", "elements, no fix")
    fixed = autotp.run(autotp.autotp_job(fixes=(FIX_ID, )))
    assert fixed.sharded_as_configured and fixed.types[0]["layers.0.mlp.down_proj"] == "LinearAllreduce", fixed
    harness.assert_close(fixed.losses, np.tile(fixed.reference_losses, (2, 1)), "float32", "losses, fixed")
    harness.assert_close(fixed.weights, fixed.reference_weights, "float32", "weights, fixed")


def check_strict_mode_names_the_truncated_name():
    from fixes.entries.autotp_partition_config_path import autotp
    from fixes.exceptions import RankFailedError

    _auto_tp()
    job = autotp.autotp_job(dict(autotp.PARTITION_CONFIG, strict_mode=True))
    try:
        autotp.run(job)
    except RankFailedError as error:
        assert (error.exc_type, error.message) == ("ValueError", "No matching spec for mlp.up_proj.weight"), error
    else:
        raise AssertionError("strict_mode did not raise on the affected release")
    assert autotp.run(job.with_(fixes=(FIX_ID, ))).sharded_as_configured


def _drifted_replace_module(self, r_module, prev_name='', prev_class_name=''):
    """Other code with the same bug: the probe still finds it, the fingerprint is not one the fix knows."""
    for name, child in r_module.named_children():
        class_name = prev_class_name + '.' + prev_name if prev_class_name else prev_name
        if self.partition_config is not None:
            full_name = prev_name + '.' + name if prev_name else name
            if self._replace_with_config(child, full_name) is None:
                self._replace_module(child, name, class_name)
    return r_module


def check_drifted_target_raises_and_patches_nothing():
    import fixes

    auto_tp = _auto_tp()
    auto_tp._replace_module = _drifted_replace_module
    assert fixes.get(FIX_ID).probe().affected, "the drifted code must still probe as affected"
    assert_drift_refused(FIX_ID, auto_tp, "_replace_module", _drifted_replace_module)


def check_first_fixed_release_is_a_noop_and_does_not_reproduce():
    import fixes

    auto_tp = _auto_tp()
    assert_noop_on_fixed_release(FIX_ID, auto_tp)
    assert "passes full_name down" in fixes.get(FIX_ID).probe().evidence
    assert _names_matched(_partition_config()) == FULL_NAMES
    assert fixes.get(FIX_ID).reproduce() is False


def check_newest_release_is_a_noop():
    import fixes

    assert_noop_on_fixed_release(FIX_ID, _auto_tp())
    assert "from class_name" in fixes.get(FIX_ID).probe().evidence


def check_release_without_custom_patterns_is_not_affected():
    import fixes

    _auto_tp()
    fix = fixes.get(FIX_ID)
    assert "no partition_config branch" in fix.probe().evidence
    assert [o.action for o in fixes.apply(FIX_ID)] == ["not needed"]
    assert fix.reproduce() is False


def test_when_applied_then_the_patterns_see_the_whole_path_and_the_linear_policies_path_is_unchanged():
    call_in_release(AFFECTED, check_the_patterns_see_the_whole_path_only_with_the_fix)


def test_when_applied_then_the_ranks_hold_their_shards_and_train_like_plain_pytorch():
    call_in_release(AFFECTED, check_with_the_fix_the_ranks_hold_their_shards_and_train_like_plain_pytorch)


def test_when_strict_mode_on_affected_release_then_the_error_names_the_truncated_name():
    call_in_release(AFFECTED, check_strict_mode_names_the_truncated_name)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_release_passes_the_full_name_down_then_apply_is_a_noop():
    call_in_release(FIRST_FIXED, check_first_fixed_release_is_a_noop_and_does_not_reproduce)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_newest_release_is_a_noop)


def test_when_release_has_no_custom_patterns_then_not_affected():
    call_in_release(WITHOUT_PATTERNS, check_release_without_custom_patterns_is_not_affected)
