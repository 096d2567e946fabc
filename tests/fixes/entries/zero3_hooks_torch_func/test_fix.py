"""zero3-hooks-torch-func beyond the notebook: the helper without the patch and the audit of each hook style (0.18.9
legacy, the newest new-style). The helper's pieces in fixes/zero3.py: tests/fixes/test_zero3.py."""
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


@pytest.mark.parametrize("release", [LEGACY, NEWEST])
def test_when_audited_then_hook_classes_are_found_with_their_style(release):
    call_in_release(release, check_audit_lists_the_hook_classes)
