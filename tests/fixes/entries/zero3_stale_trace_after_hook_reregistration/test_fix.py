"""zero3-stale-trace-after-hook-reregistration beyond the contract and the notebook (0.19.0, three dtypes on two ranks):
the trace the crash comes from, one rank, and the entry's plain-PyTorch reference. ZeRO-3 on CPU (gloo)."""
from tests.helpers import call_in_release

AFFECTED = "0.19.0"


def _setup():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_stale_trace_after_hook_reregistration import generation

    harness.setup()
    return fixes, harness, generation


def check_the_crash_and_the_trace_it_comes_from():
    """The exact error, and the ids: every registration counts on from where the last one stopped."""
    _, harness, g = _setup()
    assert g.run(g.job()).error_line == "IndexError: pop from an empty deque"
    [facts, _] = harness.launch(g.trace_facts, g.WORLD_SIZE, g.job())
    first, trained, regenerated = facts["states"][0], facts["states"][-2], facts["states"][-1]
    assert list(first["ds_id per module"].values()) == list(range(len(first["ds_id per module"]))), first
    ids = list(trained["ds_id per module"].values())  # after the first generation registered the hooks once again
    assert trained["fetch steps recorded for ds_ids"] == regenerated["fetch steps recorded for ds_ids"]
    # the outer module gets the id the last module had
    assert list(regenerated["ds_id per module"].values()) == [i + ids[-1] - ids[0] for i in ids], regenerated


def check_with_the_fix_every_state_of_the_trace_and_one_rank():
    fixes, harness, g = _setup()
    fixes.apply("zero3-stale-trace-after-hook-reregistration")
    [facts, _] = harness.launch(g.trace_facts, g.WORLD_SIZE, g.job())
    assert [s["trace"] for s in facts["states"]] == ["INVALID", "INVALID", "RECORD", "INVALID"], facts
    one_rank = g.run(g.job(), world_size=1)
    assert one_rank.trains_like_pytorch(), one_rank.comparisons()


def check_the_reference_is_the_harness_reference():
    """``plain_reference``'s losses and weights are ``harness.train_reference``'s, bit for bit: TinyMLP inside
    ``PolicyModel``, gradients averaged in fp32 for fp32 and in the model's dtype otherwise."""
    import numpy as np

    _, harness, g = _setup()
    for dtype in ("float32", "bfloat16", "float16"):
        job = g.job(dtype)
        ours = g.plain_reference(job)
        grad_dtype = None if dtype == "float32" else harness.dtype_of(dtype)
        theirs = harness.train_reference(job, world_size=g.WORLD_SIZE, grad_dtype=grad_dtype)
        assert np.array_equal(ours.losses.T.reshape(-1), np.array(theirs.losses)), dtype
        assert {f"base_model.{k}": v for k, v in theirs.params.items()}.keys() == ours.params.keys()
        assert all(np.array_equal(ours.params[f"base_model.{k}"], v) for k, v in theirs.params.items()), dtype
        assert ours.completions.shape == (g.WORLD_SIZE, job.steps, job.micro_batch, g.NEW_TOKENS, 4)


def test_when_hooks_are_registered_again_then_the_next_step_pops_an_empty_deque():
    call_in_release(AFFECTED, check_the_crash_and_the_trace_it_comes_from)


def test_when_applied_then_the_trace_is_invalidated_and_one_rank_trains_like_plain_pytorch():
    call_in_release(AFFECTED, check_with_the_fix_every_state_of_the_trace_and_one_rank, timeout=600)


def test_when_the_reference_is_computed_then_it_is_the_harness_reference():
    call_in_release(AFFECTED, check_the_reference_is_the_harness_reference)
