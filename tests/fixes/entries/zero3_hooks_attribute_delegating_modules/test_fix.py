"""zero3-hooks-attribute-delegating-modules, in child processes (ZeRO-3, one rank, gloo): what the fix's ``hasattr``
answers, upstream's counter test, and 0.16.0, where the hook classes are made lazily inside the hooks."""
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
LAZY = "0.16.0"  # _register_hooks_recursively: the hook classes are made inside the forward hooks
FIX_ID = "zero3-hooks-attribute-delegating-modules"


def _offload_module():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero import parameter_offload

    return parameter_offload


def check_applied_hasattr_is_instance_local_for_the_hook_state_only():
    import torch
    import fixes
    from fixes.entries.zero3_hooks_attribute_delegating_modules.delegation import ModulesToSaveWrapper

    module = _offload_module()
    wrapper = ModulesToSaveWrapper(torch.nn.Linear(2, 2))
    child, plain = wrapper.modules_to_save["default"], torch.nn.Linear(2, 2)
    child.pre_bwd_fn, child.ds_grads_remaining, plain.post_bwd_fn = object, 0, object
    assert fixes.apply(FIX_ID)[0].action == "applied"
    shim = module.hasattr
    assert hasattr(wrapper, "pre_bwd_fn") and hasattr(wrapper, "ds_grads_remaining")  # the builtin delegates
    assert not shim(wrapper, "pre_bwd_fn") and not shim(wrapper, "ds_grads_remaining")  # the fix does not
    assert shim(child, "pre_bwd_fn") and shim(plain, "post_bwd_fn") and not shim(plain, "pre_bwd_fn")
    assert shim(wrapper, "weight") and shim(wrapper, "in_features")  # any other name: the builtin
    assert shim(wrapper, "original_module") and not shim(wrapper, "no_such_attribute")
    assert shim(object(), "__class__") and not shim(object(), "pre_bwd_fn")  # not a module: the builtin


def check_counters_are_instance_local_with_the_fix():
    """Upstream's regression test (PR #8144): own hook classes, both pre-backward counters 0 after each backward."""
    import fixes
    from fixes.entries.zero3_hooks_attribute_delegating_modules.delegation import PEFT, counters_after_backward, job

    _offload_module()
    fixes.apply(FIX_ID)
    counters = counters_after_backward(job(steps=3), PEFT)
    assert counters == [{"wrapper": 0, "child": 0, "wrapper has own hook classes": True}] * 3, counters


def check_lazy_release_peft_trains_and_the_own_parameter_wrapper_fails_in_backward():
    from fixes.entries.zero3_hooks_attribute_delegating_modules.delegation import PEFT, SCALED, job, run

    module = _offload_module()
    assert "_register_hooks_recursively" in vars(module.DeepSpeedZeRoOffload)
    peft = run(job(), PEFT)
    assert peft.error is None and peft.matches, peft.error_line or peft.comparisons()
    scaled = run(job(), SCALED)
    assert scaled.bug_error == "backward", scaled.error_line


def check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched():
    import fixes

    module = _offload_module()
    del module.DeepSpeedZeRoOffload._register_deepspeed_module
    probe = fixes.get(FIX_ID).probe()
    assert not probe.affected and "neither registration method" in probe.evidence, probe
    assert fixes.apply(FIX_ID)[0].action == "not needed"
    assert "hasattr" not in vars(module) and not fixes.get(FIX_ID).applied


def test_when_applied_then_hasattr_answers_from_the_module_itself_for_the_hook_state_only():
    call_in_release(AFFECTED, check_applied_hasattr_is_instance_local_for_the_hook_state_only)


def test_when_applied_then_each_module_has_its_own_hook_classes_and_counters():
    call_in_release(AFFECTED, check_counters_are_instance_local_with_the_fix)


def test_when_hook_classes_are_made_lazily_then_only_a_wrapper_with_own_parameters_fails():
    call_in_release(LAZY, check_lazy_release_peft_trains_and_the_own_parameter_wrapper_fails_in_backward)


def test_when_no_registration_method_exists_then_the_probe_says_so_and_nothing_is_patched():
    call_in_release(AFFECTED, check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched)
