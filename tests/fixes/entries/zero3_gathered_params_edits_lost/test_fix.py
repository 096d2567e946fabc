"""zero3-gathered-params-edits-lost on its reproduce release 0.18.4 (no detection at all), on the newest release
(upstream's detection, behind zero_optimization.enable_sanity_checks), and on a GatheredParameters whose check runs on
every exit (what a fixed release would hold: apply is a no-op), in child processes; two ZeRO-3 ranks on CPU (gloo)."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_noop_on_fixed_release,
                           assert_same_objects, call_in_release, snapshot)

AFFECTED = "0.18.4"
NEWEST = releases.load().newest
FIX_ID = "zero3-gathered-params-edits-lost"
RACE_ID = "zero3-gathered-params-cpu-race"


def _owner():
    """GatheredParameters, the owner of both targets."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    return GatheredParameters


def check_protocol_on_affected_release():
    from deepspeed.runtime.zero.partition_parameters import Init

    gathered = _owner()
    init_before = snapshot(Init)
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, gathered)
    assert_same_objects(Init, init_before)  # the required cpu-race fix was reverted with it


def check_both_methods_wrapped_and_the_required_fix_applied():
    import fixes
    from deepspeed.runtime.zero.partition_parameters import Init

    gathered = _owner()
    originals = vars(gathered)["__enter__"], vars(gathered)["__exit__"]
    gather = vars(Init)["_allgather_params_coalesced"]
    assert "never checks for edits" in fixes.get(FIX_ID).probe().evidence
    assert [o.action for o in fixes.apply(FIX_ID)] == ["applied"]
    assert vars(gathered)["__enter__"].__wrapped__ is originals[0]
    assert vars(gathered)["__exit__"].__wrapped__ is originals[1]
    assert fixes.get(RACE_ID).applied and vars(Init)["_allgather_params_coalesced"] is not gather
    fixes.revert(FIX_ID)
    assert (vars(gathered)["__enter__"], vars(gathered)["__exit__"]) == originals
    assert not fixes.get(RACE_ID).applied and vars(Init)["_allgather_params_coalesced"] is gather


def check_each_edit_is_lost_then_raises_on_every_rank():
    from fixes import harness
    from fixes.entries.zero3_gathered_params_edits_lost import MESSAGE
    from fixes.entries.zero3_gathered_params_edits_lost.edits import EDITS, edit_job, run

    _owner()
    job = edit_job()
    broken = run(job)
    assert broken.silently_lost == list(EDITS), broken
    harness.assert_differs(broken.losses, broken.reference_losses, job.dtype, "losses, no fix")
    harness.assert_differs(broken.params, broken.reference_params, job.dtype, "weights, no fix")
    fixed = run(job.with_(fixes=(FIX_ID, )))
    assert fixed.raised and fixed.losses is None, fixed
    assert all(error.startswith(MESSAGE) for errors in fixed.errors for error in errors), fixed.errors


def check_the_documented_load_with_the_fix_matches_plain_pytorch():
    """modifier_rank=0, what the error tells the user to write, with the fix applied (every read-only gather of the
    harness goes through the check too): fp32 and bf16 train as plain PyTorch from the loaded weights."""
    from fixes import harness
    from fixes.entries.zero3_gathered_params_edits_lost.edits import edit_job, run

    _owner()
    for dtype in ("float32", "bfloat16"):
        job = edit_job(dtype=dtype, fixes=(FIX_ID, ))
        result = run(job, modifier_rank=0)
        assert not any(any(errors) for errors in result.errors) and all(all(h) for h in result.held), result
        harness.assert_close(result.losses, result.reference_losses, dtype, f"{dtype}: losses, modifier_rank=0")
        harness.assert_close(result.params, result.reference_params, dtype, f"{dtype}: weights, modifier_rank=0")


def check_reads_and_forwards_inside_the_block_do_not_raise():
    from fixes.entries.zero3_gathered_params_edits_lost.edits import reads_and_one_rank_edits
    from fixes.harness import launch

    _owner()
    for rank in launch(reads_and_one_rank_edits, 2, (FIX_ID, ), timeout=240):
        assert rank == {"read": "", "forward inside, after initialize": "", "read after a step": "",
                        "rank 0 scales its own share through .data": "raised",
                        "rank 0 alone scales a parameter under no_grad": "raised"}, rank


def check_newest_release_loses_edits_by_default_and_data_edits_with_sanity_checks():
    """Upstream's detection is there but off by default; on, it misses edits through .data. The fix raises in both."""
    import fixes
    from fixes.entries.zero3_gathered_params_edits_lost.edits import edit_job, run
    from fixes.entries.zero3_gathered_params_edits_lost.reproduce import reproduce

    _owner()
    assert "enable_sanity_checks" in fixes.get(FIX_ID).probe().evidence
    assert reproduce() is True
    sanity = edit_job(config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                    "enable_sanity_checks": True}})
    upstream = run(sanity, ("load_state_dict", "data_copy"))
    assert [bool(e) for e in upstream.errors[0]] == [True, False], upstream  # upstream raises on the first only
    assert not any(upstream.held[0]), upstream
    fixed = run(sanity.with_(fixes=(FIX_ID, )), ("data_copy", ))
    assert fixed.raised, fixed
    fixes.apply(FIX_ID)
    try:
        assert reproduce() is False
    finally:
        fixes.revert(FIX_ID)


def _enter_checking_always(self):
    """A GatheredParameters.__enter__ as a fixed release would write it: versions recorded on every entry."""
    self.params[0].all_gather(param_list=self.params)
    self._param_versions = [(p, p.data.data_ptr(), p._version) for p in self.params]


def _exit_checking_always(self, *exc):
    """... and the exit that raises on "in-place modification"."""
    raise RuntimeError("Detected in-place modification of ZeRO-3 parameters inside GatheredParameters")


def check_release_that_checks_every_exit_is_a_noop():
    import fixes

    gathered = _owner()
    gathered.__enter__, gathered.__exit__ = _enter_checking_always, _exit_checking_always
    assert_noop_on_fixed_release(FIX_ID, gathered)
    assert "on every exit" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_both_methods_are_wrapped_and_revert_restores_them():
    call_in_release(AFFECTED, check_both_methods_wrapped_and_the_required_fix_applied)


def test_when_weights_are_edited_without_modifier_rank_then_lost_and_with_the_fix_every_rank_raises():
    call_in_release(AFFECTED, check_each_edit_is_lost_then_raises_on_every_rank)


def test_when_loaded_with_modifier_rank_and_the_fix_then_training_matches_plain_pytorch():
    call_in_release(AFFECTED, check_the_documented_load_with_the_fix_matches_plain_pytorch)


def test_when_blocks_only_read_then_the_fix_raises_nothing_and_edits_on_one_rank_raise_everywhere():
    call_in_release(AFFECTED, check_reads_and_forwards_inside_the_block_do_not_raise)


def test_when_newest_release_then_still_affected_by_default_and_the_fix_raises():
    call_in_release(NEWEST, check_newest_release_loses_edits_by_default_and_data_edits_with_sanity_checks)


def test_when_the_release_checks_every_exit_then_apply_is_a_noop():
    call_in_release(AFFECTED, check_release_that_checks_every_exit_is_a_noop)
