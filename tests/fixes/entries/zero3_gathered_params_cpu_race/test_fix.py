"""zero3-gathered-params-cpu-race beyond the contract and the notebook (0.18.9, two ranks vs plain PyTorch): the probe
on an accelerator that orders the gathers, and the wrapper's splitting rule on its own (no DeepSpeed)."""
import pytest

from tests.helpers import call_in_release

FIX_ID = "zero3-gathered-params-cpu-race"


def check_probe_sees_an_accelerator_that_orders_the_gathers():
    import fixes
    from fixes.harness import setup

    setup()
    from deepspeed.accelerator import get_accelerator

    fix, accelerator = fixes.get(FIX_ID), type(get_accelerator())
    assert fix.probe().affected
    accelerator.resolves_data_dependency = lambda self: False  # what CUDA answers: DeepSpeed synchronizes
    probe = fix.probe()
    assert not probe.affected and "orders all of them" in probe.evidence, probe


def test_when_the_accelerator_synchronizes_then_the_probe_says_not_affected():
    call_in_release("0.18.9", check_probe_sees_an_accelerator_that_orders_the_gathers)


@pytest.mark.parametrize(("skips_synchronize", "params", "calls"), [
    (True, ["a", "b", "c"], [["a"], ["b"], ["c"]]),  # CPU: one parameter per call, in DeepSpeed's order
    (True, ["a"], [["a"]]),
    (False, ["a", "b", "c"], [["a", "b", "c"]]),  # CUDA: the original, untouched
])
def test_when_several_parameters_are_gathered_then_the_wrapper_splits_them_only_where_needed(
        monkeypatch, skips_synchronize, params, calls):
    from fixes.entries import zero3_gathered_params_cpu_race as entry

    seen = []

    def original(self, param_list, hierarchy=0, quantize=False):
        seen.append((list(param_list), hierarchy, quantize))

    monkeypatch.setattr(entry, "_skips_synchronize", lambda: skips_synchronize)
    assert entry._one_at_a_time(original)(object(), params, 3, quantize=True) is None
    assert seen == [(call, 3, True) for call in calls]
