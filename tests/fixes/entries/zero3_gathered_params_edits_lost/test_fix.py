"""zero3-gathered-params-edits-lost beyond the notebook: the newest release's own detection (behind
zero_optimization.enable_sanity_checks, blind to edits through .data), and a GatheredParameters that checks every exit
(what a fixed release would hold; no release swept does): apply is a no-op."""
import fixes
from ci import releases
from fixes import harness
from tests.helpers import assert_same_objects, call_in_release, snapshot

FIX_ID = "zero3-gathered-params-edits-lost"


def check_upstreams_sanity_checks_miss_data_edits_and_the_fix_raises():
    from fixes.entries.zero3_gathered_params_edits_lost.edits import edit_job, run

    harness.setup()
    sanity = edit_job(config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                    "enable_sanity_checks": True}})
    upstream = run(sanity, ("load_state_dict", "data_copy"))
    assert [bool(e) for e in upstream.errors[0]] == [True, False], upstream  # upstream raises on the first only
    assert not any(upstream.held[0]), upstream
    assert run(sanity.with_(fixes=(FIX_ID, )), ("data_copy", )).raised


def _enter_checking_always(self):
    self.params[0].all_gather(param_list=self.params)
    self._param_versions = [(p, p.data.data_ptr(), p._version) for p in self.params]


def _exit_checking_always(self, *exc):
    raise RuntimeError("Detected in-place modification of ZeRO-3 parameters inside GatheredParameters")


def check_release_that_checks_every_exit_is_a_noop():
    harness.setup()
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters as gathered

    gathered.__enter__, gathered.__exit__ = _enter_checking_always, _exit_checking_always
    before = snapshot(gathered)
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed" and "not affected" in outcome.message, outcome
    assert "on every exit" in outcome.message, outcome
    assert_same_objects(gathered, before)
    assert not fixes.get(FIX_ID).applied


def test_when_newest_release_checks_with_sanity_checks_then_data_edits_are_missed_and_the_fix_raises():
    call_in_release(releases.load().newest, check_upstreams_sanity_checks_miss_data_edits_and_the_fix_raises)


def test_when_the_release_checks_every_exit_then_apply_is_a_noop():
    call_in_release("0.18.4", check_release_that_checks_every_exit_is_a_noop)
