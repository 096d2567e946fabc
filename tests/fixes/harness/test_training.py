"""The plain-PyTorch reference (no DeepSpeed needed)."""
import pytest
import torch

from fixes.harness import Job, TinyMLP, assert_close, compare, ds_config, train_reference


def test_when_keep_names_every_micro_batch_then_it_equals_the_full_reference():
    job = Job(micro_steps=3, optimizer="adam", lr=1e-3)
    assert_close(train_reference(job, keep=(0, 1, 2)).params, train_reference(job).params, "float32")


def test_when_keep_drops_a_micro_batch_then_the_result_differs():
    job = Job(micro_steps=3, optimizer="adam", lr=1e-3)
    assert not compare(train_reference(job, keep=(0, 2)).params, train_reference(job).params, "float32").close


def test_when_backwards_are_summed_then_it_equals_gas_times_the_learning_rate_under_sgd():
    # SGD: summing 2 micro-losses (gas=1, 2 backwards) is averaging them (gas=2) with twice the lr.
    summed = train_reference(Job(backwards=2, lr=0.05))
    averaged = train_reference(Job(micro_steps=2, lr=0.1))
    assert_close(summed.params, averaged.params, "float32")


def test_when_both_micro_steps_and_backwards_are_set_then_job_is_refused():
    with pytest.raises(ValueError, match="not both"):
        Job(micro_steps=2, backwards=2)


def test_when_low_precision_then_master_weights_start_from_the_rounded_model():
    # One SGD step with lr 0 leaves the bf16 model exactly as cast: the master was made from it.
    result = train_reference(Job(dtype="bfloat16", lr=0.0, steps=1))
    cast = {name: p.detach().to(torch.bfloat16).float().numpy() for name, p in TinyMLP().named_parameters()}
    assert_close(result.params, cast, "float32")


def test_when_config_is_built_then_defaults_that_moved_between_releases_are_pinned():
    config = ds_config(Job(zero_stage=2, offload=True), world_size=2)
    assert config["gradient_clipping"] == 0.0
    assert config["zero_force_ds_cpu_optimizer"] is False
    assert config["train_batch_size"] == 4 * 1 * 2
    assert config["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu"}}


def test_when_initial_zero_step_then_sgd_is_unchanged_and_adam_starts_one_step_ahead():
    # FP16_UnfusedOptimizer steps once on zero gradients at construction: SGD (no momentum) does not move,
    # Adam's step count (bias correction) does.
    sgd, adam = Job(steps=2), Job(steps=2, optimizer="adam", lr=0.01)
    assert_close(train_reference(sgd, initial_zero_step=True).params, train_reference(sgd).params, "float32")
    assert not compare(train_reference(adam, initial_zero_step=True).params, train_reference(adam).params,
                       "float32").close



def test_when_an_entry_asks_for_a_bench_job_then_it_gets_the_bench_model_with_its_own_changes():
    import importlib

    from fixes.harness import bench_job
    from fixes.harness.models import BENCH_MICRO_BATCH, BENCH_MODEL

    job = bench_job(zero_stage=3, zero3_init=True)
    assert (job.model, job.micro_batch, job.optimizer) == (BENCH_MODEL, BENCH_MICRO_BATCH, "adam")
    assert (job.zero_stage, job.zero3_init) == (3, True)
    assert bench_job(optimizer="sgd", dtype="float16").optimizer == "sgd"
    entry = importlib.import_module("fixes.entries.zero3_hooks_torch_func.reproduce")
    assert entry.bench_job() == job  # the three ZeRO-3 entries time the same job
