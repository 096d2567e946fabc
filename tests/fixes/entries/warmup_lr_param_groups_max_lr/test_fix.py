"""warmup-lr-param-groups-max-lr in child processes: every way of giving or omitting the peak on an affected release,
and a release before the regression (0.16.0), whose default the fix leaves alone."""
from tests.helpers import call_in_release

AFFECTED = "0.18.9"
BEFORE_THE_REGRESSION = "0.16.0"  # an omitted warmup_max_lr meant 0.001 for every group (before PR #7360)
FIX_ID = "warmup-lr-param-groups-max-lr"


def _two_groups(lrs=(1e-2, 1e-1)):
    import torch

    model = torch.nn.Linear(2, 2)
    return torch.optim.AdamW([{"params": [model.weight], "lr": lrs[0]}, {"params": [model.bias], "lr": lrs[1]}])


def check_an_explicit_peak_is_kept_and_every_way_of_omitting_it_is_fixed():
    import fixes
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.lr_schedules import WarmupDecayLR, WarmupLR

    fixes.apply(FIX_ID)
    assert WarmupLR(_two_groups()).max_lrs == [1e-2, 1e-1]  # omitted
    assert WarmupLR(_two_groups(), 0.0, None).max_lrs == [1e-2, 1e-1]  # None, positionally
    assert WarmupLR(_two_groups(), warmup_max_lr=0.5).max_lrs == [0.5, 0.5]  # a number: as before
    assert WarmupLR(_two_groups(), warmup_max_lr=[0.3, 0.4]).max_lrs == [0.3, 0.4]  # a list: as before
    assert WarmupDecayLR(_two_groups(), 10, warmup_max_lr=None).max_lrs == [1e-2, 1e-1]  # inherits __init__
    assert WarmupDecayLR(_two_groups(), 10).max_lrs == [0.001, 0.001]  # its own default: untouched


def check_release_before_the_regression_keeps_its_default():
    import fixes
    from fixes.entries.warmup_lr_param_groups_max_lr.reproduce import reproduce
    from fixes.harness import setup

    setup()
    from deepspeed.runtime.lr_schedules import WarmupLR

    assert fixes.apply(FIX_ID)[0].action == "not needed" and not fixes.get(FIX_ID).applied and reproduce() is False
    assert WarmupLR(_two_groups()).max_lrs == [0.001, 0.001]  # the documented default of those releases


def test_when_applied_then_an_explicit_peak_is_kept_and_an_omitted_one_is_each_groups_own_lr():
    call_in_release(AFFECTED, check_an_explicit_peak_is_kept_and_every_way_of_omitting_it_is_fixed)


def test_when_release_predates_the_regression_then_the_fix_leaves_its_default():
    call_in_release(BEFORE_THE_REGRESSION, check_release_before_the_regression_keeps_its_default)
