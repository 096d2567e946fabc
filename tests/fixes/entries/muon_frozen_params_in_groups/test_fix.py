"""muon-frozen-params-in-groups on its reproduce release (0.17.6): with the fix, DeepSpeed's Muon over a model with
frozen parameters against plain PyTorch under ZeRO-1 and ZeRO-2 (each choice of frozen parameters), ZeRO-0's
frozen parameters left alone, and other optimizers' parameters left as they were. The notebook shows ZeRO-1's."""
import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.17.6"
FIX_ID = "muon-frozen-params-in-groups"


def check_zero12_with_the_fix_match_plain_pytorch():
    from fixes.entries.muon_frozen_params_in_groups.reproduce import muon_job, reference, train

    harness.setup()
    fixes.apply(FIX_ID)
    try:
        for stage in (1, 2):
            for frozen in ("biases", "weights", "fc1"):
                job = muon_job(stage)
                trained = train(job, frozen)
                assert trained.frozen and not trained.changed_frozen(), (stage, frozen, trained.changed_frozen())
                assert all(group["params"] for group in trained.groups), trained.groups
                harness.assert_close(trained.after, reference(job, frozen).params, "float32",
                                     f"ZeRO-{stage}, {frozen} frozen, vs plain PyTorch")
    finally:
        fixes.revert(FIX_ID)


def check_zero0_with_the_fix_steps_no_frozen_parameter():
    from fixes.entries.muon_frozen_params_in_groups.reproduce import muon_job, reference, train

    harness.setup()
    fixes.apply(FIX_ID)
    try:
        for frozen in ("biases", "weights", "fc1"):
            trained = train(muon_job(0), frozen)
            assert trained.frozen and not trained.changed_frozen(), (frozen, trained.changed_frozen())
        # only the biases train: the Adam half alone, against torch.optim.AdamW
        job = muon_job(0)
        harness.assert_close(train(job, "weights").after, reference(job, "weights").params, "float32",
                             "ZeRO-0, the weights frozen, vs plain PyTorch")
    finally:
        fixes.revert(FIX_ID)


def check_other_optimizers_get_every_parameter():
    import deepspeed

    from fixes.entries.muon_frozen_params_in_groups.reproduce import frozen_model

    harness.setup()
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}}

    def parameters_in_groups():
        model = frozen_model("fc1")
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        return sum(len(group["params"]) for group in engine.optimizer.param_groups)

    unfixed = parameters_in_groups()
    fixes.apply(FIX_ID)
    try:
        assert parameters_in_groups() == unfixed == 4
    finally:
        fixes.revert(FIX_ID)


def test_when_applied_with_zero1_and_zero2_then_muon_matches_plain_pytorch():
    call_in_release(AFFECTED, check_zero12_with_the_fix_match_plain_pytorch)


def test_when_applied_with_zero0_then_no_frozen_parameter_is_stepped():
    call_in_release(AFFECTED, check_zero0_with_the_fix_steps_no_frozen_parameter)


def test_when_applied_then_other_optimizers_get_every_parameter():
    call_in_release(AFFECTED, check_other_optimizers_get_every_parameter)
