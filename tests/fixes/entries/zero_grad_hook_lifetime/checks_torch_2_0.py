"""Checks run inside the torch-2.0 environment's Python (no pytest there): see test_torch_2_0.py."""
FIX_ID = "zero-grad-hook-lifetime"


def check_real_torch_2_0_index_error_empty_bucket_then_fix_equals_plain_sgd():
    import torch

    import fixes
    from fixes import harness
    from fixes.entries.zero_grad_hook_lifetime.reproduce import measurement_context, reproduce, torch_before_2_1

    assert torch.__version__.startswith("2.0."), f"torch {torch.__version__} is not PyTorch 2.0"
    assert torch_before_2_1()
    harness.setup()
    import deepspeed.utils.torch as helpers

    assert not helpers.required_torch_version(min_version=2.1), "DeepSpeed does not see torch < 2.1"
    fix = fixes.get(FIX_ID)
    probe = fix.probe()
    assert probe.affected and "simulated" not in probe.evidence, probe
    with measurement_context():  # nothing to select on torch 2.0
        assert "simulated" not in fix.probe().evidence
        assert reproduce() is True

    # The symptom as reported: engine.backward raises IndexError on an empty IPG bucket; no hook fired.
    engine = harness.build_engine(harness.Job(zero_stage=2))
    calls = []
    original = engine.optimizer.process_gradients
    engine.optimizer.process_gradients = lambda *args: (calls.append(1), original(*args))[1]
    x, y = harness.make_batches(harness.ModelSpec(), 1).micro(0, 0, 0)
    try:
        engine.backward(harness.mse(engine(x), y))
    except IndexError as exc:
        assert "list index out of range" in str(exc), exc
    else:
        raise AssertionError("engine.backward did not raise IndexError on torch 2.0")
    [bucket] = engine.optimizer.ipg_buckets.values()
    assert (len(bucket.buffer), bucket.index, bucket.elements) == (0, 0, 0), vars(bucket)
    assert calls == [], f"{len(calls)} gradient hooks fired"

    # The fix: every hook fires, and two steps give the parameters of plain-PyTorch SGD.
    assert [o.action for o in fixes.apply(FIX_ID)] == ["applied"]
    try:
        assert reproduce() is False
        run = harness.versus_reference("ZeRO-2 [float32]", harness.Job(zero_stage=2))
        comparison = harness.assert_close(run.deepspeed.params, run.reference.params, "float32", "parameters")
        assert comparison.max_abs_diff == 0.0, comparison
    finally:
        fixes.revert(FIX_ID)
    assert fix.probe().affected
    print("torch", torch.__version__, "— real IndexError, empty bucket; fixed:", comparison)
