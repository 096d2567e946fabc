"""autotuning-nested-config-value-missed on its reproduce release, on the oldest swept release and on the newest
(fixed) one, in child processes."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_noop_on_fixed_release, call_in_release,
                           assert_same_objects, snapshot)

AFFECTED = "0.19.3"
FIX_ID = "autotuning-nested-config-value-missed"
# upstream's test of PR #8177: "device" lives in the second top-level subdict
UPSTREAM_EXP = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


def _modules():
    from fixes.harness import setup

    setup()
    from fixes.entries.autotuning_nested_config_value_missed import _SCHEDULER, _UTILS

    return _UTILS.owner_and_name()[0], _SCHEDULER.owner_and_name()[0]


def check_protocol_on_affected_release():
    utils, scheduler = _modules()
    before = snapshot(scheduler)
    assert scheduler.get_val_by_key is utils.get_val_by_key, "run_job's name is not the utils function"
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, utils)
    assert_same_objects(scheduler, before)


def check_the_fixed_search_is_upstreams_and_serves_run_job():
    import copy

    import fixes
    from fixes.entries.autotuning_nested_config_value_missed import reproduce as repro

    utils, scheduler = _modules()
    exp = copy.deepcopy(UPSTREAM_EXP)
    assert utils.get_val_by_key(exp, "device") is None, "the second subdict is already searched on this release"
    config = repro.user_config()
    experiment = repro.micro_batch_experiment(config, 3, 8)
    before = repro.schedule(experiment, config)
    assert before.args.zero_stage == 0 and before.args.per_device_train_batch_size == 8, before.shown
    fixes.apply(FIX_ID)
    try:
        assert scheduler.get_val_by_key is utils.get_val_by_key  # run_job calls the fixed search
        # upstream's test, line by line
        assert utils.get_val_by_key(exp, "device") == "cpu"
        assert utils.get_val_by_key(exp, "missing_key") is None
        assert utils.get_val_by_key(exp, "type") == "Adam"
        utils.set_val_by_key(exp, "device", "nvme")
        assert utils.get_val_by_key(exp, "device") == "nvme"
        # a value found at the top, or in the first subdict, is what the installed search returns
        nested = {"a": 1, "b": {"c": {"d": 0}}, "e": {"d": 5}}
        assert utils.get_val_by_key(nested, "a") == 1 and utils.get_val_by_key(nested, "d") == 0
        # the user's experiments: every tuned stage (0 is never passed on, as before), and the profile run
        for stage in (1, 2, 3):
            launch = repro.schedule(repro.micro_batch_experiment(config, stage, 8), config)
            assert launch.args.zero_stage == stage and launch.args.per_device_train_batch_size == 8, launch.shown
            assert launch.script_args.count("--zero_stage") == 1
        profile = repro.schedule(repro.profile_experiment(config), config)
        assert profile.args.zero_stage == 3 and profile.args.per_device_train_batch_size == 1, profile.shown
        assert not repro.runs_at_another_stage(repro.micro_batch_experiment(config, 0, 8), config)
    finally:
        fixes.revert(FIX_ID)
    assert utils.get_val_by_key(exp, "device") is None


def check_zero_first_config_is_not_hit():
    """With zero_optimization as the first section that is a dict, the installed search finds the stage: the
    trigger's note, measured."""
    from fixes.entries.autotuning_nested_config_value_missed import reproduce as repro

    _modules()
    config = repro.user_config(zero_first=True)
    launch = repro.schedule(repro.micro_batch_experiment(config, 3, 8), config)
    assert launch.args.zero_stage == 3, launch.shown


def check_fixed_release_is_a_noop():
    from fixes.entries.autotuning_nested_config_value_missed.reproduce import reproduce

    utils, scheduler = _modules()
    before = snapshot(scheduler)
    assert_noop_on_fixed_release(FIX_ID, utils)
    assert_same_objects(scheduler, before)
    assert reproduce() is False
    assert utils.get_val_by_key(dict(UPSTREAM_EXP), "device") == "cpu"


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_upstreams_checks_pass_and_run_job_passes_every_tuned_stage():
    call_in_release(AFFECTED, check_the_fixed_search_is_upstreams_and_serves_run_job)


def test_when_zero_optimization_is_the_first_dict_section_then_the_stage_is_passed_without_the_fix():
    call_in_release(AFFECTED, check_zero_first_config_is_not_hit)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
