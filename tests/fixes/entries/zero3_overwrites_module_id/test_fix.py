"""zero3-overwrites-module-id on its reproduce release (0.16.0), in child processes: the shape of the recompiled
methods, a release without either registration method, and composing with other fixes that replace them."""
from tests.helpers import assert_drift_refused, call_in_release

AFFECTED = "0.16.0"
FIX_ID = "zero3-overwrites-module-id"


def _classes():
    """``(DeepSpeedZeRoOffload, PartitionedParameterCoordinator)``: the classes whose methods the fix replaces."""
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    return DeepSpeedZeRoOffload, PartitionedParameterCoordinator


def _inner(function):
    """The innermost function the fix compiled (not following ``__wrapped__`` to the installed one)."""
    while not function.__code__.co_filename.startswith("<fixes"):
        cells = dict(zip(function.__code__.co_freevars, function.__closure__ or ()))
        function = next((cells[name].cell_contents for name in ("func", "fn") if name in cells), None)
        assert function is not None, "a replacement holds no inner function"
    return function


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
            replacement, original = target.raw(), originals[target.dotted]
            assert replacement is not original and replacement.__wrapped__ is original  # others' drift checks see it
            assert target.code() is undecorated(original) and type(replacement) is type(original)
            owner, name = target.owner_and_name()
            assert _inner(replacement).__qualname__ == target.code().__qualname__ == f"{owner.__name__}.{name}"
        assert vars(offload)["_register_hooks_recursively"].__defaults__[0] is register_default  # the shared counter
        fetch = _inner(vars(coordinator)["fetch_sub_module"])  # three decorators, `self.__x` mangled, `__class__`
        code = fetch.__code__
        assert code.co_filename.startswith("<fixes zero3-overwrites-module-id:"), code.co_filename
        assert "_PartitionedParameterCoordinator__inflight_param_registry" in code.co_names, code.co_names
        assert fetch.__closure__[code.co_freevars.index("__class__")].cell_contents is coordinator
        source = inspect.getsource(fetch)  # from linecache: the code that runs
        assert "current_submodule.ds_id" in source and "current_submodule.id" not in source
    finally:
        fixes.revert(FIX_ID)
    assert all(target.raw() is originals[target.dotted] for target in TARGETS)


def check_delegating_hooks_fix_applies_with_it_in_either_order():
    import fixes

    other = "zero3-hooks-attribute-delegating-modules"  # it fingerprints _register_hooks_recursively too
    _classes()
    for order in ((FIX_ID, other), (other, FIX_ID)):
        try:
            assert [o.action for o in fixes.apply(*order)] == ["applied", "applied"], order
        finally:
            fixes.revert(*order)
        assert not fixes.get(FIX_ID).applied and not fixes.get(other).applied


def check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched():
    import fixes

    offload, _ = _classes()
    del offload._register_hooks_recursively
    probe = fixes.get(FIX_ID).probe()
    assert not probe.affected and "neither registration method" in probe.evidence, probe
    assert fixes.apply(FIX_ID)[0].action == "not needed"


def check_a_method_another_fix_replaced_is_refused_not_dropped():
    import functools
    import fixes

    offload, coordinator = _classes()
    original, namespace = vars(offload)["_register_hooks_recursively"], {}
    exec(compile("def register(self, module, count=[0]):\n    return original(self, module, count)\n",  # noqa: S102
                 "<fixes another-fix>", "exec"), {"original": original}, namespace)
    offload._register_hooks_recursively = other = functools.wraps(original)(namespace["register"])
    assert_drift_refused(FIX_ID, coordinator, says="already replaced by another fix")
    assert vars(offload)["_register_hooks_recursively"] is other


def test_when_applied_then_each_method_is_the_installed_one_renamed_with_its_decorators_and_class():
    call_in_release(AFFECTED, check_replacements_keep_decorators_defaults_mangling_and_class)


def test_when_applied_with_the_delegating_hooks_fix_then_both_apply_in_either_order():
    call_in_release(AFFECTED, check_delegating_hooks_fix_applies_with_it_in_either_order)


def test_when_no_registration_method_exists_then_the_probe_says_so_and_nothing_is_patched():
    call_in_release(AFFECTED, check_without_a_registration_method_the_probe_says_so_and_nothing_is_patched)


def test_when_another_fix_replaced_a_method_first_then_apply_refuses_and_drops_nothing():
    call_in_release(AFFECTED, check_a_method_another_fix_replaced_is_refused_not_dropped)
