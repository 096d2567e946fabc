"""zero3-hooks-torch-func on 0.18.9 (legacy hook classes: setup_context error), on the newest
release 0.19.8 (new-style hook classes: the process dies with SIGSEGV), both still affected, and on
0.16.0, affected but without a fix (apply() refuses)."""
import pytest

from ci import releases
from tests.helpers import assert_apply_is_idempotent_and_revert_exact, assert_same_objects, call_in_release, snapshot

LEGACY = "0.18.9"
OLDEST = "0.16.0"
NEWEST = releases.load().newest
FIX_ID = "zero3-hooks-torch-func"


def _classes():
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    return DeepSpeedZeRoOffload, PartitionedParameterCoordinator


def _case(*transforms, fixes=(), train_after=False, steps=2):
    from fixes.entries.zero3_hooks_torch_func.func_transforms import FuncCase, zero3_func_job

    return FuncCase(zero3_func_job(steps=steps), transforms=transforms, fixes=fixes, train_after=train_after)


def _assert_matches_plain_pytorch(outcome):
    from fixes.entries.zero3_hooks_torch_func.func_transforms import compare_outcome, reference_transforms

    assert not outcome.failed, outcome
    comparisons = compare_outcome(outcome, reference_transforms(outcome.case, outcome.world_size))
    assert comparisons and all(c.close for c in comparisons), [str(c) for c in comparisons if not c.close]
    for result in outcome.results:
        assert result["parameters released after the transforms"].all()


def check_protocol():
    offload, coordinator = _classes()
    coordinator_before = snapshot(coordinator)
    assert_apply_is_idempotent_and_revert_exact(FIX_ID, offload)
    assert_same_objects(coordinator, coordinator_before)


def check_protocol_patches_coordinator_and_requirement():
    import fixes
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    _, coordinator = _classes()
    linear = fixes.get("zero3-linear-setup-context")
    linear_needed = linear.is_affected()  # True on 0.18.9, False from 0.19.1
    original_reset_step = vars(coordinator)["reset_step"]
    linear_forward = vars(LinearFunctionForZeroStage3)["forward"]
    fixes.apply(FIX_ID)
    assert vars(coordinator)["reset_step"] is not original_reset_step
    assert linear.applied is linear_needed
    fixes.revert(FIX_ID)
    assert vars(coordinator)["reset_step"] is original_reset_step
    assert vars(LinearFunctionForZeroStage3)["forward"] is linear_forward  # the requirement was reverted too
    assert not fixes.get("zero3-linear-setup-context").applied


def check_bug_shows_then_fix_matches_plain_pytorch():
    import fixes
    from fixes.entries.zero3_hooks_torch_func.func_transforms import run_case_in_child

    _classes()
    fix = fixes.get(FIX_ID)
    assert fix.probe().affected
    assert fix.reproduce() is True
    fixed = run_case_in_child(_case("grad", "grad_and_value", "jacrev", "vmap_grad", "param_grad_helper",
                                    fixes=(FIX_ID, ), train_after=True))
    _assert_matches_plain_pytorch(fixed)


def check_fix_on_two_ranks_matches_plain_pytorch():
    from fixes.entries.zero3_hooks_torch_func.func_transforms import run_case_in_child

    _classes()
    _assert_matches_plain_pytorch(run_case_in_child(_case("grad", "vmap_grad", "param_grad_helper", fixes=(FIX_ID, ),
                                                          train_after=True), world_size=2))


def check_in_process_fix_then_revert_restores_the_setup_context_error():
    """On a legacy release the bug is a clean RuntimeError, so it can be shown in this process."""
    import fixes
    import torch
    from fixes.harness import build_engine, mse
    from fixes.entries.zero3_hooks_torch_func.func_transforms import rank_inputs, zero3_func_job

    _classes()
    job = zero3_func_job(steps=1)
    x, y = rank_inputs(job, 1, 0)
    fixes.apply(FIX_ID)
    model = build_engine(job).module  # the hook classes are made at registration: apply first
    grad = torch.func.grad(lambda inp: mse(model(inp), y))(x)
    assert grad.shape == x.shape and torch.isfinite(grad).all()
    fixes.revert(FIX_ID)
    fixes.apply("zero3-linear-setup-context")  # only this entry's own bug is back
    model = build_engine(job).module
    with pytest.raises(RuntimeError, match="must override the setup_context staticmethod"):
        torch.func.grad(lambda inp: mse(model(inp), y))(x)


def check_no_fix_before_0_16_8_is_refused_and_patches_nothing():
    """0.16.0 - 0.16.7: no fix. Their post-backward hook resets ds_grads_remaining only once (0.16.8 on:
    at every forward), so with the hook classes converted torch.func gives the right numbers but the
    parameters stay gathered after the transform and a later GatheredParameters fails in free_param
    (measured on 0.16.0). apply() refuses before touching anything, the required fix included."""
    import fixes
    from deepspeed.runtime.zero.linear import LinearFunctionForZeroStage3

    offload, coordinator = _classes()
    before, coordinator_before = snapshot(offload), snapshot(coordinator)
    linear_before = snapshot(LinearFunctionForZeroStage3)
    assert fixes.get(FIX_ID).probe().affected
    try:
        fixes.apply(FIX_ID)
    except fixes.DriftError as exc:
        assert "is not the code this fix was written for" in str(exc), exc
    else:
        raise AssertionError("the fix applied on a release it has no fix for")
    assert_same_objects(offload, before)
    assert_same_objects(coordinator, coordinator_before)
    assert_same_objects(LinearFunctionForZeroStage3, linear_before)
    assert not fixes.get(FIX_ID).applied and not fixes.get("zero3-linear-setup-context").applied


def check_helper_alone_gives_parameter_gradients_and_restores_hooks():
    """The workaround without the patch: gathered parameters + functional_call with ZeRO-3's hooks suspended."""
    from fixes.entries.zero3_hooks_torch_func.func_transforms import run_case_in_child

    _classes()
    outcome = run_case_in_child(_case("param_grad_helper", fixes=("zero3-linear-setup-context", )))
    _assert_matches_plain_pytorch(outcome)
    naive = run_case_in_child(_case("param_grad", fixes=(FIX_ID, ), steps=1))
    assert naive.failed and naive.symptom == "ds_status AttributeError", naive


def check_hooks_suspended_restores_every_hook_dict_exactly():
    import fixes
    from fixes.harness import build_engine
    from fixes.entries.zero3_hooks_torch_func.func_transforms import zero3_func_job
    from fixes.zero3 import _is_zero3_hook, zero3_hooks_suspended

    _classes()
    fixes.apply("zero3-linear-setup-context")
    model = build_engine(zero3_func_job(steps=1)).module
    before = {(name, attr): list(getattr(sub, attr).items()) for name, sub in model.named_modules()
              for attr in ("_forward_pre_hooks", "_forward_hooks")}
    zero3 = [hook for hooks in before.values() for _, hook in hooks if _is_zero3_hook(hook)]
    others = [hook for hooks in before.values() for _, hook in hooks if not _is_zero3_hook(hook)]
    assert len(zero3) >= 4 * 3, zero3  # pre/post forward, pre/post backward on TinyMLP, fc1, fc2
    assert others, "the engine's own forward hooks should be there (and must be kept)"
    with zero3_hooks_suspended(model):
        inside = [hook for sub in model.modules() for attr in ("_forward_pre_hooks", "_forward_hooks")
                  for hook in getattr(sub, attr).values()]
        assert [id(h) for h in inside] == [id(h) for h in others]
    after = {(name, attr): list(getattr(sub, attr).items()) for name, sub in model.named_modules()
             for attr in ("_forward_pre_hooks", "_forward_hooks")}
    assert after.keys() == before.keys()
    for key in before:
        assert [(k, id(h)) for k, h in after[key]] == [(k, id(h)) for k, h in before[key]], key


def check_audit_lists_the_hook_classes():
    from fixes.entries.zero3_hooks_torch_func.autograd_audit import audit_autograd_functions

    import deepspeed

    functions = {f.name: f for f in audit_autograd_functions()}
    hooks = [functions[name] for name in ("PreBackwardFunctionForModule", "PostBackwardFunctionModule")]
    legacy = deepspeed.__version__ == LEGACY
    assert all(f.legacy is legacy for f in hooks), hooks
    assert functions["LinearFunctionForZeroStage3"].legacy is legacy
    assert all(f.qualname.startswith("DeepSpeedZeRoOffload._register_deepspeed_module.") for f in hooks)


@pytest.mark.parametrize("release", [LEGACY, NEWEST])
def test_when_applied_then_idempotent_and_revert_is_exact(release):
    call_in_release(release, check_protocol)


@pytest.mark.parametrize("release", [LEGACY, NEWEST])
def test_when_applied_then_coordinator_and_required_fix_are_reverted_too(release):
    call_in_release(release, check_protocol_patches_coordinator_and_requirement)


@pytest.mark.parametrize("release", [LEGACY, NEWEST])
def test_when_unfixed_then_bug_shows_and_when_fixed_then_torch_func_matches_plain_pytorch(release):
    call_in_release(release, check_bug_shows_then_fix_matches_plain_pytorch)


def test_when_fixed_on_two_ranks_then_torch_func_and_training_match_plain_pytorch():
    call_in_release(NEWEST, check_fix_on_two_ranks_matches_plain_pytorch)


def test_when_reverted_then_the_setup_context_error_is_back():
    call_in_release(LEGACY, check_in_process_fix_then_revert_restores_the_setup_context_error)


def test_when_release_is_older_than_0_16_8_then_apply_refuses_and_patches_nothing():
    call_in_release(OLDEST, check_no_fix_before_0_16_8_is_refused_and_patches_nothing)


@pytest.mark.parametrize("release", [LEGACY, NEWEST])
def test_when_helper_used_then_parameter_gradients_match_and_plain_functional_call_still_fails(release):
    call_in_release(release, check_helper_alone_gives_parameter_gradients_and_restores_hooks)


def test_when_hooks_suspended_then_every_hook_dict_is_restored_exactly():
    call_in_release(NEWEST, check_hooks_suspended_restores_every_hook_dict_exactly)


@pytest.mark.parametrize("release", [LEGACY, NEWEST])
def test_when_audited_then_hook_classes_are_found_with_their_style(release):
    call_in_release(release, check_audit_lists_the_hook_classes)


def test_when_parameters_are_gathered_then_each_is_gathered_on_its_own(monkeypatch):
    # Several parameters in one GatheredParameters race on CPU up to DeepSpeed 0.19.7 (only the last
    # async all-gather is waited for, PR #8539); the helper must never hand DeepSpeed more than one.
    import contextlib
    import sys
    import types

    import torch

    from fixes.zero3 import gathered_parameters

    gathered: list[list[torch.Tensor]] = []
    open_blocks: list[int] = []

    @contextlib.contextmanager
    def recording_gather(params):
        gathered.append(list(params))
        open_blocks.append(1)
        try:
            yield
        finally:
            open_blocks.pop()

    fake = types.SimpleNamespace(zero=types.SimpleNamespace(GatheredParameters=recording_gather))
    monkeypatch.setitem(sys.modules, "deepspeed", fake)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with gathered_parameters(model) as params:
        assert len(open_blocks) == 4, "every parameter stays gathered for the whole block"
        assert all(not p.requires_grad for p in params.values())
    assert [len(group) for group in gathered] == [1, 1, 1, 1]
    assert all(group[0] is param for group, param in zip(gathered, model.parameters()))
    assert list(params) == [name for name, _ in model.named_parameters()] and not open_blocks
