"""fixes.zero3, the helper for torch.func on ZeRO-3 modules: hook suspension on a real ZeRO-3 engine (the newest
release, in a child process) and the one-parameter-at-a-time gather."""
import torch

from ci import releases
from tests.helpers import call_in_release


def check_hooks_suspended_restores_every_hook_dict_exactly():
    import fixes
    from fixes import harness
    from fixes.zero3 import _is_zero3_hook, zero3_hooks_suspended

    harness.setup()
    fixes.apply("zero3-linear-setup-context")  # ZeRO-3's linear on this torch, where that release needs it
    model = harness.build_engine(harness.Job(zero_stage=3, steps=1)).module
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


def test_when_hooks_suspended_then_every_hook_dict_is_restored_exactly():
    call_in_release(releases.load().newest, check_hooks_suspended_restores_every_hook_dict_exactly)


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
