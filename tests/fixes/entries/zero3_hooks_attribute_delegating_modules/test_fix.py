"""zero3-hooks-attribute-delegating-modules in child processes: on its reproduce release (0.18.9: hook classes made at
registration, legacy ``forward(ctx, ...)``), on 0.16.0 (classes made lazily inside the hooks), on 0.19.2 (the last
affected: classes with ``setup_context``), and on the newest (fixed upstream). ZeRO-3 on one rank, CPU (gloo)."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, assert_same_objects, call_in_release, snapshot)

AFFECTED = "0.18.9"
LAZY = "0.16.0"  # _register_hooks_recursively: the hook classes are made inside the forward hooks
FIX_ID = "zero3-hooks-attribute-delegating-modules"


def _offload_module():
    """``deepspeed.runtime.zero.parameter_offload``: where the fix puts its ``hasattr``."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero import parameter_offload

    return parameter_offload


def check_protocol_on_affected_release():
    module = _offload_module()
    before = snapshot(module.DeepSpeedZeRoOffload)
    assert "hasattr" not in vars(module)
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, module)
    assert "hasattr" not in vars(module)
    assert_same_objects(module.DeepSpeedZeRoOffload, before)  # no DeepSpeed method is replaced


def check_applied_hasattr_is_instance_local_for_the_hook_state_only():
    import fixes
    import torch

    from fixes.entries.zero3_hooks_attribute_delegating_modules.delegation import ModulesToSaveWrapper

    module = _offload_module()
    wrapper = ModulesToSaveWrapper(torch.nn.Linear(2, 2))
    child = wrapper.modules_to_save["default"]
    child.pre_bwd_fn, child.ds_grads_remaining = object, 0
    plain = torch.nn.Linear(2, 2)
    plain.post_bwd_fn = object
    assert fixes.apply(FIX_ID)[0].action == "applied"
    try:
        shim = module.hasattr
        assert hasattr(wrapper, "pre_bwd_fn") and hasattr(wrapper, "ds_grads_remaining")  # the builtin delegates
        assert not shim(wrapper, "pre_bwd_fn") and not shim(wrapper, "ds_grads_remaining")  # the fix does not
        assert shim(child, "pre_bwd_fn") and shim(plain, "post_bwd_fn") and not shim(plain, "pre_bwd_fn")
        assert shim(wrapper, "weight") and shim(wrapper, "in_features")  # any other name: the builtin
        assert shim(wrapper, "original_module") and not shim(wrapper, "no_such_attribute")
        assert shim(object(), "__class__") and not shim(object(), "pre_bwd_fn")  # not a module: the builtin
    finally:
        assert fixes.revert(FIX_ID)[0].action == "reverted"
    assert "hasattr" not in vars(module)


def check_peft_wrapper_crashes_in_forward_and_trains_with_the_fix_in_every_dtype():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_hooks_attribute_delegating_modules.delegation import MODELS, PEFT, SCALED, job, run

    _offload_module()
    for model_name in MODELS:
        broken = run(job(), model_name)
        assert broken.bug_error == "forward", broken.error_line
        assert "has no attribute 'ds_grads_remaining'" in broken.error_line, broken.error_line
    fixes.apply(FIX_ID)
    try:
        for model_name, dtype in [(PEFT, "float32"), (PEFT, "bfloat16"), (PEFT, "float16"), (SCALED, "float32")]:
            fixed = run(job(dtype), model_name)
            assert fixed.error is None, fixed.error_line
            harness.assert_close(fixed.params, fixed.reference_params, dtype, f"{model_name} {dtype}: weights")
            harness.assert_close(fixed.losses, fixed.reference_losses, dtype, f"{model_name} {dtype}: losses")
            assert fixed.frozen_kept is not False
    finally:
        fixes.revert(FIX_ID)


def check_counters_are_instance_local_with_the_fix():
    """Upstream's regression test (PR #8144), in this process: the wrapper holds hook classes of its own, and
    the wrapper's and the child's pre-backward counters are 0 after every backward."""
    import fixes
    from fixes.entries.zero3_hooks_attribute_delegating_modules.delegation import PEFT, counters_after_backward, job

    _offload_module()
    fixes.apply(FIX_ID)
    try:
        counters = counters_after_backward(job(steps=3), PEFT)
    finally:
        fixes.revert(FIX_ID)
    assert counters == [{"wrapper": 0, "child": 0, "wrapper has own hook classes": True}] * 3, counters


def check_lazy_release_peft_trains_and_the_own_parameter_wrapper_fails_in_backward():
    from fixes.entries.zero3_hooks_attribute_delegating_modules.delegation import PEFT, SCALED, job, run

    module = _offload_module()
    assert "_register_hooks_recursively" in vars(module.DeepSpeedZeRoOffload)
    peft = run(job(), PEFT)
    assert peft.error is None and peft.matches, peft.error_line or peft.comparisons()
    scaled = run(job(), SCALED)
    assert scaled.bug_error == "backward", scaled.error_line


def check_drifted_target_raises_and_patches_nothing():
    import fixes

    def _register_deepspeed_module(self, module, count=[0]):
        if not hasattr(module, "pre_bwd_fn"):  # still the delegated check, but the rest of the method is gone
            module.pre_bwd_fn = None

    module = _offload_module()
    assert_drift_refused(FIX_ID, module.DeepSpeedZeRoOffload, "_register_deepspeed_module", _register_deepspeed_module)
    assert "hasattr" not in vars(module) and not fixes.get(FIX_ID).applied


def check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched():
    import fixes

    module = _offload_module()
    del module.DeepSpeedZeRoOffload._register_deepspeed_module
    probe = fixes.get(FIX_ID).probe()
    assert not probe.affected and "neither registration method" in probe.evidence, probe
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed", outcome
    assert "hasattr" not in vars(module) and not fixes.get(FIX_ID).applied


def check_fixed_release_is_a_noop():
    import fixes

    module = _offload_module()
    assert_noop_on_fixed_release(FIX_ID, module)
    assert "hasattr" not in vars(module)
    assert "does not check the hook classes with hasattr" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_hasattr_answers_from_the_module_itself_for_the_hook_state_only():
    call_in_release(AFFECTED, check_applied_hasattr_is_instance_local_for_the_hook_state_only)


def test_when_a_delegating_wrapper_trains_then_it_crashes_and_with_the_fix_matches_plain_pytorch():
    call_in_release(AFFECTED, check_peft_wrapper_crashes_in_forward_and_trains_with_the_fix_in_every_dtype)


def test_when_applied_then_each_module_has_its_own_hook_classes_and_counters():
    call_in_release(AFFECTED, check_counters_are_instance_local_with_the_fix)


def test_when_hook_classes_are_made_lazily_then_only_a_wrapper_with_own_parameters_fails():
    call_in_release(LAZY, check_lazy_release_peft_trains_and_the_own_parameter_wrapper_fails_in_backward)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_no_registration_method_exists_then_the_probe_says_so_and_nothing_is_patched():
    call_in_release(AFFECTED, check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)
