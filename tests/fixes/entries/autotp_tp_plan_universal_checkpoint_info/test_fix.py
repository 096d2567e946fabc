"""autotp-tp-plan-universal-checkpoint-info: the info the fix attaches on 0.18.9 (affected) is the info AutoTP's
partition_config route attaches for the same layers, the sharding is unchanged, the routes that attach it themselves
and autotp_size 1 are left alone; the user's job (ZeRO-1 and ZeRO-2) converts and resumes like plain PyTorch with
the fix; 0.19.8 (upstream's fix) and 0.18.8 (no tp_plan route) need nothing."""
import pytest

from tests.helpers import call_in_release

AFFECTED = "0.18.9"
FIX_ID = "autotp-tp-plan-universal-checkpoint-info"


def _infos(job, tp_plan_default=True):
    from fixes.entries.autotp_tp_plan_universal_checkpoint_info import tp_plan
    from fixes.harness import launch

    plan = tp_plan.TP_PLAN if tp_plan_default else None
    world_size = job.config["tensor_parallel"]["autotp_size"]
    return launch(tp_plan.info_in_rank, world_size, job, plan, timeout=240)


def check_the_fix_attaches_what_the_partition_config_route_attaches():
    from fixes import harness
    from fixes.entries.autotp_tp_plan_universal_checkpoint_info import tp_plan

    harness.setup()
    broken = _infos(tp_plan.autotp_job())
    assert [rank["info"] for rank in broken] == [None, None]
    fixed = _infos(tp_plan.autotp_job(fixes=(FIX_ID, )))
    by_config = _infos(tp_plan.autotp_job(partition_config=tp_plan.PARTITION_CONFIG))
    for rank in range(2):
        info = fixed[rank]["info"]
        assert info["parameter_with_row_parallelism_patterns"] == tp_plan.ROW_PARALLEL, info
        assert info["tp_replicated_parameter_patterns"] == tp_plan.REPLICATED, info
        assert info == by_config[rank]["info"], (info, by_config[rank]["info"])
        # the fix changes no sharding: each rank holds half of every MLP weight, the same with and without it
        assert fixed[rank]["held"] == broken[rank]["held"] == by_config[rank]["held"]
        assert fixed[rank]["held"]["layers.0.mlp.up_proj.weight"] == (tp_plan.INTERMEDIATE // 2, tp_plan.HIDDEN)
        assert fixed[rank]["held"]["layers.0.mlp.down_proj.weight"] == (tp_plan.HIDDEN, tp_plan.INTERMEDIATE // 2)
        assert fixed[rank]["types"] == broken[rank]["types"]


def check_the_fix_leaves_the_other_routes_and_autotp_size_1_alone():
    """The partition_config route attaches its own info (the wrapper adds nothing); with autotp_size 1 nothing is
    sharded and, as upstream's code leaves it, no info is attached."""
    from fixes import harness
    from fixes.entries.autotp_tp_plan_universal_checkpoint_info import tp_plan

    harness.setup()
    config_job = tp_plan.autotp_job(partition_config=tp_plan.PARTITION_CONFIG)
    assert _infos(config_job.with_(fixes=(FIX_ID, ))) == _infos(config_job)
    [one] = _infos(tp_plan.autotp_job(autotp_size=1, fixes=(FIX_ID, )))
    assert one["info"] is None
    assert one["held"]["layers.0.mlp.down_proj.weight"] == (tp_plan.HIDDEN, tp_plan.INTERMEDIATE)


def check_the_users_job_converts_and_resumes_like_pytorch_with_the_fix(zero_stage: int, inject: bool):
    import numpy as np

    from fixes import harness
    from fixes.entries.autotp_tp_plan_universal_checkpoint_info import tp_plan

    harness.setup()
    found = tp_plan.run(tp_plan.autotp_job(zero_stage=zero_stage, fixes=(FIX_ID, )), inject_missing_state=inject)
    assert not found.error, found.error
    harness.assert_close(found.losses, np.tile(found.reference_losses, (2, 1)),
                         "float32", "losses per rank vs plain PyTorch")
    harness.assert_close(found.weights, found.reference_weights, "float32", "resumed weights vs plain PyTorch")


def check_without_the_fix_the_conversion_is_refused_or_resumes_wrong():
    from fixes import harness
    from fixes.entries.autotp_tp_plan_universal_checkpoint_info import tp_plan

    harness.setup()
    refused = tp_plan.run(tp_plan.autotp_job())
    assert refused.bug and tp_plan.MISSING in refused.error, refused
    injected = tp_plan.run(tp_plan.autotp_job(), inject_missing_state=True)
    assert not injected.error, injected.error
    harness.assert_differs(injected.weights, injected.reference_weights, "float32", "resumed weights vs plain PyTorch")


def check_unaffected_release(evidence: str):
    import fixes
    from fixes import harness

    harness.setup()
    assert evidence in fixes.get(FIX_ID).probe().evidence
    assert [o.action for o in fixes.apply(FIX_ID)] == ["not needed"]


def test_when_applied_then_the_tp_plan_route_carries_the_info_of_the_partition_config_route():
    call_in_release(AFFECTED, check_the_fix_attaches_what_the_partition_config_route_attaches, timeout=600)


def test_when_applied_then_the_other_routes_and_autotp_size_1_are_unchanged():
    call_in_release(AFFECTED, check_the_fix_leaves_the_other_routes_and_autotp_size_1_alone, timeout=600)


@pytest.mark.parametrize(("zero_stage", "inject"), [(1, False), (2, False), (1, True)])
def test_when_applied_then_the_users_job_converts_and_resumes_like_plain_pytorch(zero_stage, inject):
    call_in_release(AFFECTED, check_the_users_job_converts_and_resumes_like_pytorch_with_the_fix,
                    args=(zero_stage, inject), timeout=600)


def test_when_not_applied_then_the_conversion_is_refused_or_resumes_from_wrong_weights():
    call_in_release(AFFECTED, check_without_the_fix_the_conversion_is_refused_or_resumes_wrong, timeout=600)


@pytest.mark.parametrize(("release", "evidence"), [("0.19.8", "attaches UNIVERSAL_CHECKPOINT_INFO before it returns"),
                                                   ("0.18.8", "no HuggingFace tp_plan route")])
def test_when_release_attaches_the_info_or_reads_no_tp_plan_then_not_affected(release, evidence):
    call_in_release(release, check_unaffected_release, args=(evidence, ))
