"""zero3-overwrites-module-id in child processes: on its reproduce release (0.16.0), on the last affected one (0.16.3),
on the first fixed one (0.16.4) and on the newest. ZeRO-3 on one rank, CPU (gloo)."""
from ci import releases
from tests.helpers import (assert_apply_is_idempotent_and_revert_exact, assert_drift_refused,
                           assert_noop_on_fixed_release, assert_same_objects, call_in_release, snapshot)

AFFECTED = "0.16.0"
LAST_AFFECTED = "0.16.3"
FIRST_FIXED = "0.16.4"
FIX_ID = "zero3-overwrites-module-id"


def _classes():
    """``(DeepSpeedZeRoOffload, PartitionedParameterCoordinator)``: the classes whose methods the fix replaces."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    return DeepSpeedZeRoOffload, PartitionedParameterCoordinator


def check_protocol_on_affected_release():
    offload, coordinator = _classes()
    before = snapshot(coordinator)
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, offload)
    assert_same_objects(coordinator, before)


def check_replacements_keep_decorators_defaults_mangling_and_class():
    import inspect

    import fixes
    from fixes.entries.zero3_overwrites_module_id import TARGETS
    from fixes.patching import undecorated

    offload, coordinator = _classes()
    originals = {target.dotted: target.raw() for target in TARGETS}
    register_default = vars(offload)["_register_hooks_recursively"].__defaults__[0]
    assert fixes.apply(FIX_ID)[0].action == "applied"
    try:
        for target in TARGETS:
            replacement = target.raw()
            assert replacement is not originals[target.dotted]
            assert replacement.__wrapped__ is originals[target.dotted]  # other fixes' drift checks see the installed code
            assert target.code() is undecorated(originals[target.dotted])
            owner, name = target.owner_and_name()
            assert _inner(replacement).__qualname__ == target.code().__qualname__ == f"{owner.__name__}.{name}"
            assert type(replacement) is type(originals[target.dotted])
        register = vars(offload)["_register_hooks_recursively"]
        assert register.__defaults__[0] is register_default  # the counter shared with the installed method
        # fetch_sub_module: three decorators, `self.__x` mangled with the class's name, `__class__` the real class
        fetch = vars(coordinator)["fetch_sub_module"]
        code = _inner(fetch).__code__
        assert code.co_filename.startswith("<fixes zero3-overwrites-module-id:"), code.co_filename
        assert "_PartitionedParameterCoordinator__inflight_param_registry" in code.co_names, code.co_names
        cell = _inner(fetch).__closure__[code.co_freevars.index("__class__")]
        assert cell.cell_contents is coordinator
        source = inspect.getsource(_inner(fetch))  # from linecache: the code that runs
        assert "current_submodule.ds_id" in source and "current_submodule.id" not in source
    finally:
        fixes.revert(FIX_ID)
    assert all(target.raw() is originals[target.dotted] for target in TARGETS)


def _inner(function):
    """The innermost function the fix compiled (not following ``__wrapped__`` to the installed one)."""
    while not function.__code__.co_filename.startswith("<fixes"):
        names = function.__code__.co_freevars
        cells = dict(zip(names, function.__closure__ or ()))
        nxt = next((cells[name].cell_contents for name in ("func", "fn") if name in cells), None)
        if nxt is None:
            raise AssertionError(f"{function} holds no inner function")
        function = nxt
    return function


def check_user_ids_lost_and_training_wrong_then_kept_and_matching_in_every_dtype():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_overwrites_module_id.experts import ATTRIBUTE, PROPERTY, job, run

    _classes()
    broken = run(job(), ATTRIBUTE)
    assert broken.error is None, broken.error_line
    assert broken.ids_before == {"experts.0": 0, "experts.1": 1}
    assert broken.ids_after != broken.ids_before, broken.ids_after
    assert not broken.matches and broken.shows_bug
    crashed = run(job(), PROPERTY)
    assert crashed.bug_error, crashed.error_line
    fixes.apply(FIX_ID)
    try:
        for model_name, dtype in [(ATTRIBUTE, "float32"), (ATTRIBUTE, "bfloat16"), (ATTRIBUTE, "float16"),
                                  (PROPERTY, "float32")]:
            fixed = run(job(dtype), model_name)
            assert fixed.error is None, fixed.error_line
            assert fixed.ids_after == fixed.ids_before == {"experts.0": 0, "experts.1": 1}, fixed.ids_after
            assert all(isinstance(number, int) for number in fixed.ds_ids.values()), fixed.ds_ids
            harness.assert_close(fixed.params, fixed.reference_params, dtype, f"{model_name} {dtype}: weights")
            harness.assert_close(fixed.losses, fixed.reference_losses, dtype, f"{model_name} {dtype}: losses")
    finally:
        fixes.revert(FIX_ID)


def check_upstream_client_module_id_survives_initialize():
    """Upstream's regression test (PR #6847), in this process: the model's own ``id`` is the same after
    ``deepspeed.initialize`` (read through the engine, as upstream does, and on the module)."""
    import deepspeed
    import torch

    import fixes
    from fixes import harness

    class MyModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.id = 3
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x)

    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3},
              "zero_allow_untested_optimizer": True}
    _classes()
    fixes.apply(FIX_ID)
    try:
        model = MyModel()
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                               config=config)
        assert engine.module.id == 3 and engine.id == 3, (engine.module.id, engine.id)
        assert isinstance(engine.module.ds_id, int) and isinstance(engine.module.fc.ds_id, int)
        loss = engine(torch.ones(1, 8, device=harness.device())).sum()
        engine.backward(loss)
        engine.step()
        assert engine.module.id == 3
    finally:
        fixes.revert(FIX_ID)


def check_delegating_hooks_fix_applies_with_it_in_either_order():
    """``zero3-hooks-attribute-delegating-modules`` fingerprints ``_register_hooks_recursively`` too: its drift check
    must accept the installed code with this fix applied first, and this fix must apply after it."""
    import fixes

    other = "zero3-hooks-attribute-delegating-modules"
    _classes()
    for order in ((FIX_ID, other), (other, FIX_ID)):
        try:
            for fix_id in order:
                assert fixes.apply(fix_id)[0].action == "applied", fix_id
        finally:
            fixes.revert(*order)
        assert not fixes.get(FIX_ID).applied and not fixes.get(other).applied


def check_drifted_target_raises_and_patches_nothing():
    import fixes

    def release_sub_module(self, submodule):
        for param in submodule.parameters():  # still reads .id, but not the code the fix was written for
            param.ds_active_sub_modules.discard(submodule.id)

    offload, coordinator = _classes()
    before = snapshot(offload)
    assert_drift_refused(FIX_ID, coordinator, "release_sub_module", release_sub_module)
    assert_same_objects(offload, before)
    assert not fixes.get(FIX_ID).applied


def check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched():
    import fixes

    offload, _ = _classes()
    del offload._register_hooks_recursively
    probe = fixes.get(FIX_ID).probe()
    assert not probe.affected and "neither registration method" in probe.evidence, probe
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "not needed", outcome


def check_fixed_release_is_a_noop():
    import fixes

    offload, coordinator = _classes()
    before = snapshot(coordinator)
    assert_noop_on_fixed_release(FIX_ID, offload)
    assert_same_objects(coordinator, before)
    assert "module.ds_id" in fixes.get(FIX_ID).probe().evidence


def test_when_applied_on_affected_release_then_idempotent_and_revert_is_exact():
    call_in_release(AFFECTED, check_protocol_on_affected_release)


def test_when_applied_then_each_method_is_the_installed_one_renamed_with_its_decorators_and_class():
    call_in_release(AFFECTED, check_replacements_keep_decorators_defaults_mangling_and_class)


def test_when_experts_keep_their_index_in_id_then_it_is_lost_and_with_the_fix_kept_and_training_matches():
    call_in_release(AFFECTED, check_user_ids_lost_and_training_wrong_then_kept_and_matching_in_every_dtype, timeout=600)


def test_when_applied_then_upstreams_client_module_id_survives_initialize():
    call_in_release(LAST_AFFECTED, check_upstream_client_module_id_survives_initialize)


def test_when_applied_with_the_delegating_hooks_fix_then_both_apply_in_either_order():
    call_in_release(AFFECTED, check_delegating_hooks_fix_applies_with_it_in_either_order)


def test_when_target_drifted_then_drift_error_and_nothing_patched():
    call_in_release(AFFECTED, check_drifted_target_raises_and_patches_nothing)


def test_when_no_registration_method_exists_then_the_probe_says_so_and_nothing_is_patched():
    call_in_release(AFFECTED, check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched)


def test_when_release_is_fixed_upstream_then_apply_is_a_noop():
    call_in_release(FIRST_FIXED, check_fixed_release_is_a_noop)
    call_in_release(releases.load().newest, check_fixed_release_is_a_noop)


def check_a_method_another_fix_replaced_is_refused_not_dropped():
    import functools

    import fixes

    offload, coordinator = _classes()
    original = vars(offload)["_register_hooks_recursively"]
    namespace = {}
    exec(compile("def register(self, module, count=[0]):\n    return original(self, module, count)\n",  # noqa: S102
                 "<fixes another-fix>", "exec"), {"original": original}, namespace)
    other = functools.wraps(original)(namespace["register"])
    offload._register_hooks_recursively = other
    before = snapshot(coordinator)
    try:
        fixes.apply(FIX_ID)
    except fixes.DriftError as exc:
        assert "already replaced by another fix" in str(exc), exc
    else:
        raise AssertionError("another fix's replacement was recompiled over")
    assert vars(offload)["_register_hooks_recursively"] is other and not fixes.get(FIX_ID).applied
    assert_same_objects(coordinator, before)


def test_when_another_fix_replaced_a_method_first_then_apply_refuses_and_drops_nothing():
    call_in_release(AFFECTED, check_a_method_another_fix_replaced_is_refused_not_dropped)
