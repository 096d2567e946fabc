"""Checks of ``fixes.apply()`` run inside a release's child process (any environment: this module
imports neither pytest nor the test helpers, so the Colab-shaped venv can run it too)."""
from __future__ import annotations


def check_apply_all_then_one_training_step() -> None:
    """``fixes.apply()`` with no ids applies every needed fix that applies here and names the others;
    then a training step (ZeRO-2 with CPU offload, 3 micro-batches: a job two entries fix) matches
    plain PyTorch under the fp32 tolerance."""
    import warnings

    import fixes
    from fixes import harness

    harness.setup()
    needed = [fix.id for fix in fixes.all_fixes() if fix.is_affected()]
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        outcomes = fixes.apply()
    actions = {o.fix_id: o.action for o in outcomes}
    print("needed:", needed, "outcomes:", actions)
    assert set(actions) == set(needed), (needed, actions)
    assert "failed" not in actions.values(), outcomes
    refused = sorted(fix_id for fix_id, action in actions.items() if action == "refused")
    named = sorted(str(w.message).split()[1] for w in warned if issubclass(w.category, fixes.FixbookWarning))
    assert named == refused, (named, refused)
    for fix_id, action in actions.items():
        if fixes.get(fix_id).info.kind == "behaviour change":  # never applied unless named
            assert action == "skipped" and not fixes.get(fix_id).applied, (fix_id, action)
            continue
        if action == "not needed":  # its bug was removed by a fix applied before it (two fixes of one function)
            assert not fixes.get(fix_id).is_affected(), (fix_id, action)
            continue
        assert action in ("applied", "already applied", "refused"), (fix_id, action)
        assert (action == "refused") or fixes.get(fix_id).applied
    versus = harness.versus_reference("one step after fixes.apply()",
                                      harness.Job(zero_stage=2, offload=True, micro_steps=3, steps=1))
    assert versus.close, versus
    fixes.revert()
    assert not any(fix.applied for fix in fixes.all_fixes())
