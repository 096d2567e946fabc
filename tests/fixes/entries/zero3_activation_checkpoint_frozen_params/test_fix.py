"""What is specific to zero3-activation-checkpoint-frozen-params, in child processes of a release
(``call_in_release``): the fixed job against plain PyTorch in each variant of the trigger's grid, no parameter left
gathered after backward, and the refusal where ZeRO-3's optimizer has no ``backward_epilogue``. Every check every
entry must pass is tests/fixes/test_contract.py's."""
from tests.helpers import call_in_release

AFFECTED = "0.19.0"
NO_EPILOGUE = "0.17.6"  # affected, but DeepSpeedZeroOptimizer_Stage3 has no backward_epilogue
FIX_ID = "zero3-activation-checkpoint-frozen-params"


def check_the_fixed_job_matches_plain_pytorch_in_every_variant():
    import fixes
    from fixes import harness
    from fixes.entries.zero3_activation_checkpoint_frozen_params.checkpointed import (NON_REENTRANT, VARIANTS, job,
                                                                                      run)

    harness.setup()
    assert fixes.get(FIX_ID).probe().affected
    bug = run(job(), NON_REENTRANT)
    assert bug.bug_error, bug.error_line
    assert fixes.apply(FIX_ID)[0].action == "applied"
    for variant in VARIANTS:
        outcome = run(job(steps=3), variant)
        assert outcome.error is None, f"{variant}: {outcome.error_line}"
        assert not outcome.left_gathered, f"{variant}: still gathered after backward: {outcome.left_gathered}"
        assert outcome.frozen_kept, f"{variant}: a frozen parameter changed"
        assert outcome.matches, [str(c) for c in outcome.comparisons()]


def check_nothing_stays_gathered_after_the_fixed_backward():
    """In this process, with the fix: the backward runs through the recompute, and after each ``engine.backward``
    no parameter is gathered and the fix's record of modules in backward (and of the frozen parameters a recompute
    attributed to them) is empty: the frozen norm's parameters, attributed to the module in backward when the
    recompute ran, were released with it, and the model's root (whose input needs no gradient, so its
    post-backward hook never fires) taken off the record by the wrapped backward_epilogue."""
    import deepspeed
    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    import fixes
    from fixes import harness
    from fixes.entries.zero3_activation_checkpoint_frozen_params import checkpointed

    harness.setup()
    fixes.apply(FIX_ID)
    spec = checkpointed.job()
    model = checkpointed.build(checkpointed.NON_REENTRANT, spec.model)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=spec.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=harness.ds_config(spec))
    batches = harness.make_batches(spec.model, 2, 1, 1, spec.micro_batch, spec.data_seed)
    for step in range(2):
        x, y = batches.micro(step, 0, 0)
        engine.backward(harness.mse(engine(x), y))
        gathered = [name for name, p in engine.module.named_parameters()
                    if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]
        assert not gathered, gathered
        coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
        assert not vars(coordinator).get("_fixbook_active_backward_submodules")
        assert not vars(coordinator).get("_fixbook_recompute_parameters")
        engine.step()


def check_without_backward_epilogue_the_fix_refuses_and_patches_nothing():
    from deepspeed.runtime.zero import partitioned_param_coordinator, stage3

    import fixes
    from fixes import harness
    from fixes.exceptions import DriftError

    harness.setup()
    fix = fixes.get(FIX_ID)
    assert fix.probe().affected
    assert "backward_epilogue" not in vars(stage3.DeepSpeedZeroOptimizer_Stage3)
    before = dict(vars(partitioned_param_coordinator.PartitionedParameterCoordinator))
    try:
        fix.apply()
    except DriftError as exc:
        assert "backward_epilogue" in str(exc), exc
    else:
        raise AssertionError("the fix applied on a release without backward_epilogue")
    assert not fix.applied
    assert dict(vars(partitioned_param_coordinator.PartitionedParameterCoordinator)) == before


def test_when_applied_then_every_variant_matches_plain_pytorch_and_nothing_stays_gathered():
    call_in_release(AFFECTED, check_the_fixed_job_matches_plain_pytorch_in_every_variant)


def test_when_applied_then_nothing_stays_gathered_after_backward():
    call_in_release(AFFECTED, check_nothing_stays_gathered_after_the_fixed_backward)


def test_when_zero3_has_no_backward_epilogue_then_the_fix_refuses():
    call_in_release(NO_EPILOGUE, check_without_backward_epilogue_the_fix_refuses_and_patches_nothing)
