"""autotuning-nested-config-value-missed on its reproduce release (0.19.3), in child processes: upstream's test of
PR #8177 and the profile run through run_job, and the config shape the installed search already handles."""
from tests.helpers import call_in_release

AFFECTED = "0.19.3"
FIX_ID = "autotuning-nested-config-value-missed"
# upstream's test of PR #8177: "device" lives in the second top-level subdict
UPSTREAM_EXP = {"optimizer": {"type": "Adam"}, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}


def _modules():
    from fixes.harness import setup

    setup()
    from fixes.entries.autotuning_nested_config_value_missed import _SCHEDULER, _UTILS

    return _UTILS.owner_and_name()[0], _SCHEDULER.owner_and_name()[0]


def check_the_fixed_search_is_upstreams_and_serves_run_job():
    import copy

    import fixes
    from fixes.entries.autotuning_nested_config_value_missed import reproduce as repro

    utils, scheduler = _modules()
    exp = copy.deepcopy(UPSTREAM_EXP)
    assert utils.get_val_by_key(exp, "device") is None, "the second subdict is already searched on this release"
    config = repro.user_config()
    fixes.apply(FIX_ID)
    assert scheduler.get_val_by_key is utils.get_val_by_key  # run_job calls the fixed search
    assert utils.get_val_by_key(exp, "device") == "cpu"  # upstream's test, line by line
    assert utils.get_val_by_key(exp, "missing_key") is None
    assert utils.get_val_by_key(exp, "type") == "Adam"
    utils.set_val_by_key(exp, "device", "nvme")
    assert utils.get_val_by_key(exp, "device") == "nvme"
    nested = {"a": 1, "b": {"c": {"d": 0}}, "e": {"d": 5}}  # found at the top or in the first subdict: as installed
    assert utils.get_val_by_key(nested, "a") == 1 and utils.get_val_by_key(nested, "d") == 0
    launch = repro.schedule(repro.micro_batch_experiment(config, 3, 8), config)  # the notebook runs stages 1-3
    assert launch.script_args.count("--zero_stage") == 1, launch.shown
    profile = repro.schedule(repro.profile_experiment(config), config)
    assert profile.args.zero_stage == 3 and profile.args.per_device_train_batch_size == 1, profile.shown
    assert not repro.runs_at_another_stage(repro.micro_batch_experiment(config, 0, 8), config)


def check_zero_first_config_is_not_hit():
    """zero_optimization the first section that is a dict: the installed search finds the stage (the trigger's note)."""
    from fixes.entries.autotuning_nested_config_value_missed import reproduce as repro

    _modules()
    config = repro.user_config(zero_first=True)
    launch = repro.schedule(repro.micro_batch_experiment(config, 3, 8), config)
    assert launch.args.zero_stage == 3, launch.shown


def test_when_applied_then_upstreams_checks_pass_and_run_job_passes_the_stage_once_and_profiles_at_zero_3():
    call_in_release(AFFECTED, check_the_fixed_search_is_upstreams_and_serves_run_job)


def test_when_zero_optimization_is_the_first_dict_section_then_the_stage_is_passed_without_the_fix():
    call_in_release(AFFECTED, check_zero_first_config_is_not_hit)
