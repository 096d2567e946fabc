"""zero3-hooks-torch-func beyond the notebook: the helper without the patch, the hook suspension, the audit of each
hook style (0.18.9 legacy, the newest new-style), and the gather helper."""
import pytest
import torch

import fixes
from ci import releases
from fixes import harness
from tests.helpers import call_in_release

LEGACY = "0.18.9"
NEWEST = releases.load().newest
FIX_ID = "zero3-hooks-torch-func"


def check_helper_alone_gives_parameter_gradients():
    """The workaround without the patch: gathered parameters + functional_call with ZeRO-3's hooks suspended."""
    from fixes.entries.zero3_hooks_torch_func.func_transforms import (FuncCase, compare_outcome, reference_transforms,
                                                                      run_case_in_child, zero3_func_job)

    harness.setup()
    outcome = run_case_in_child(FuncCase(zero3_func_job(steps=2), transforms=("param_grad_helper", ),
                                         fixes=("zero3-linear-setup-context", )))
    assert not outcome.failed, outcome
    comparisons = compare_outcome(outcome, reference_transforms(outcome.case, outcome.world_size))
    assert comparisons and all(c.close for c in comparisons), [str(c) for c in comparisons if not c.close]
    assert all(result["parameters released after the transforms"].all() for result in outcome.results)


def check_hooks_suspended_restores_every_hook_dict_exactly():
    from fixes.entries.zero3_hooks_torch_func.func_transforms import zero3_func_job
    from fixes.harness import build_engine
    from fixes.zero3 import _is_zero3_hook, zero3_hooks_suspended

    harness.setup()
    fixes.apply("zero3-linear-setup-context")
    model = build_engine(zero3_func_job(steps=1)).module
    kinds = ("_forward_pre_hooks", "_forward_hooks")

    def hooks():
        return {(name, kind): [(k, id(h)) for k, h in getattr(sub, kind).items()]
                for name, sub in model.named_modules() for kind in kinds}

    before = hooks()
    every = [hook for sub in model.modules() for kind in kinds for hook in getattr(sub, kind).values()]
    others = [id(hook) for hook in every if not _is_zero3_hook(hook)]
    assert len(every) - len(others) >= 4 * 3  # pre/post forward, pre/post backward on TinyMLP, fc1, fc2
    assert others, "the engine's own forward hooks should be there (and must be kept)"
    with zero3_hooks_suspended(model):
        assert [id(hook) for sub in model.modules() for kind in kinds for hook in getattr(sub, kind).values()] == others
    assert hooks() == before


def check_audit_lists_the_hook_classes():
    import deepspeed
    from fixes.entries.zero3_hooks_torch_func.autograd_audit import audit_autograd_functions

    functions = {f.name: f for f in audit_autograd_functions()}
    hooks = [functions[name] for name in ("PreBackwardFunctionForModule", "PostBackwardFunctionModule")]
    legacy = deepspeed.__version__ == LEGACY
    assert all(f.legacy is legacy for f in hooks) and functions["LinearFunctionForZeroStage3"].legacy is legacy, hooks
    assert all(f.qualname.startswith("DeepSpeedZeRoOffload._register_deepspeed_module.") for f in hooks)


@pytest.mark.parametrize("release", [LEGACY, NEWEST])
def test_when_helper_used_without_the_fix_then_parameter_gradients_match_plain_pytorch(release):
    call_in_release(release, check_helper_alone_gives_parameter_gradients)


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

    from fixes.zero3 import gathered_parameters

    gathered, open_blocks = [], []

    @contextlib.contextmanager
    def recording_gather(params):
        gathered.append(list(params))
        open_blocks.append(1)
        try:
            yield
        finally:
            open_blocks.pop()

    monkeypatch.setitem(sys.modules, "deepspeed",
                        types.SimpleNamespace(zero=types.SimpleNamespace(GatheredParameters=recording_gather)))
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    with gathered_parameters(model) as params:
        assert len(open_blocks) == 4, "every parameter stays gathered for the whole block"
        assert all(not p.requires_grad for p in params.values())
    assert [len(group) for group in gathered] == [1, 1, 1, 1]
    assert all(group[0] is param for group, param in zip(gathered, model.parameters()))
    assert list(params) == [name for name, _ in model.named_parameters()] and not open_blocks
