"""The plain-PyTorch reference (no DeepSpeed needed)."""
import contextlib
from types import SimpleNamespace

import pytest
import torch

from fixes.harness import Job, TinyMLP, assert_close, compare, ds_config, train_reference
from fixes.harness.training import _backward


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


def test_when_grad_dtype_is_bf16_then_a_bf16_model_averages_its_gradients_in_bf16_not_fp32():
    # The two paths round differently: the fp32 average keeps bits the bf16 sums drop (and the option is used).
    job = Job(dtype="bfloat16", micro_steps=2, steps=3)
    fp32 = train_reference(job, world_size=2)
    bf16 = train_reference(job, world_size=2, grad_dtype=torch.bfloat16)
    default = train_reference(job, world_size=2, grad_dtype=None)  # None is the default path
    assert default.grad_norms == fp32.grad_norms and all((default.params[name] == fp32.params[name]).all()
                                                          for name in fp32.params)
    assert fp32.grad_norms != bf16.grad_norms
    assert any((fp32.params[name] != bf16.params[name]).any() for name in fp32.params)


def test_when_grad_dtype_is_fp32_on_an_fp32_model_then_only_the_order_of_operations_differs():
    job = Job(micro_steps=2, steps=2, optimizer="adam", lr=1e-3)
    for keep in (None, (1,)):
        assert_close(train_reference(job, world_size=2, keep=keep, grad_dtype=torch.float32).params,
                     train_reference(job, world_size=2, keep=keep).params, "float32")


def test_when_keep_keeps_no_micro_batch_then_the_bf16_average_is_refused():
    with pytest.raises(ValueError, match="keeps no micro-batch"):
        train_reference(Job(dtype="bfloat16", micro_steps=2), world_size=2, keep=(), grad_dtype=torch.bfloat16)


def _ddp_rank(rank: int, world_size: int, meeting, job: Job, results) -> None:
    """One rank of torch DDP (gloo) on the job's bf16 model: ``no_sync`` for all but the last micro-batch,
    DDP's bf16 all-reduce, then SGD on an fp32 master copy that is copied back to the bf16 model.

    The rank sends its result, waits until it has left the process, and exits without tearing anything down.
    Freeing the DDP model frees its gloo process group, whose destructor joins the group's work thread while
    holding the GIL; that thread may be freeing a finished all-reduce, which needs the GIL. Both then wait for
    ever, and so does the queue's feeder thread, with the result still in it (seen with torch 2.13.0 on a loaded
    machine)."""
    import copy
    import os

    import torch.distributed as dist

    from fixes.harness import make_batches, mse
    from fixes.harness.training import make_optimizer

    try:
        torch.set_num_threads(1)
        os.environ.update(meeting.environ(rank, world_size))
        dist.init_process_group("gloo")
        master = TinyMLP(job.model)
        work = copy.deepcopy(master).to(torch.bfloat16)
        with torch.no_grad():
            for param, copy_ in zip(master.parameters(), work.parameters()):
                param.copy_(copy_.float())
        model = torch.nn.parallel.DistributedDataParallel(work)
        optimizer = make_optimizer(job, master.parameters())
        batches = make_batches(job.model, job.steps, job.micro_steps, world_size, job.micro_batch, job.data_seed)
        norms = []
        for step in range(job.steps):
            for micro in range(job.micro_steps):
                x, y = batches.micro(step, micro, rank)
                sync = micro == job.micro_steps - 1
                with (contextlib.nullcontext() if sync else model.no_sync()):
                    (mse(model(x.to(torch.bfloat16)), y) / job.micro_steps).backward()
            for param, copy_ in zip(master.parameters(), work.parameters()):
                param.grad = copy_.grad.float()
            norms.append(float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in master.parameters()]))))
            optimizer.step()
            work.zero_grad(set_to_none=True)
            with torch.no_grad():
                for param, copy_ in zip(master.parameters(), work.parameters()):
                    copy_.copy_(param)
        outcome = (rank, {name: p.detach().float().numpy().copy() for name, p in work.named_parameters()}, norms)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        outcome = (rank, repr(exc), None)
    results.put(outcome)
    results.close()
    results.join_thread()
    os._exit(0)


def test_when_grad_dtype_is_bf16_then_it_is_torch_ddp_on_a_bf16_model_bit_for_bit():
    import multiprocessing
    import queue

    from fixes.harness.launch import rendezvous

    job = Job(dtype="bfloat16", micro_steps=2, steps=3)
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    with rendezvous() as meeting:
        procs = [context.Process(target=_ddp_rank, args=(rank, 2, meeting, job, results), daemon=True)
                 for rank in range(2)]
        for proc in procs:
            proc.start()
        try:
            ranks = dict((rank, (params, norms)) for rank, params, norms in (results.get(timeout=120) for _ in procs))
        except queue.Empty:
            pytest.fail("the DDP ranks did not finish in 120 s")
        finally:
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.kill()
    assert all(norms is not None for _, norms in ranks.values()), ranks
    ddp_params, ddp_norms = ranks[0]
    bf16 = train_reference(job, world_size=2, grad_dtype=torch.bfloat16)
    assert bf16.grad_norms == ddp_norms
    assert all((bf16.params[name] == ddp_params[name]).all() for name in ddp_params)
    default = train_reference(job, world_size=2)  # the fp32 average is not what DDP computes for a bf16 model
    assert default.grad_norms != ddp_norms


def _grads(mode: str) -> list[torch.Tensor]:
    """TinyMLP's gradients after one backward in ``mode``, where ``engine.backward`` is plain ``loss.backward()``."""
    model, engine = TinyMLP(), SimpleNamespace(backward=lambda loss: loss.backward())
    x, y = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.zeros(4, 4)
    _backward(engine, mode, model(x), y)
    return [p.grad for p in model.parameters()]


def test_when_backward_mode_is_unknown_then_job_is_refused():
    with pytest.raises(ValueError, match="unknown backward"):
        Job(backward="autograd")


@pytest.mark.parametrize("mode", ["tensor", "tensor-grad"])
def test_when_backward_is_direct_then_it_computes_the_same_gradients_as_engine_backward(mode):
    for direct, via_engine in zip(_grads(mode), _grads("engine")):
        torch.testing.assert_close(direct, via_engine)


def test_when_an_entry_builds_its_own_model_and_optimizer_then_the_reference_trains_exactly_those():
    job = Job(steps=2)
    default = train_reference(job)
    same = train_reference(job, build_model=TinyMLP, build_optimizer=lambda master: torch.optim.SGD(master.parameters(),
                                                                                                     lr=job.lr))
    assert same.losses == default.losses
    assert all((same.params[name] == default.params[name]).all() for name in default.params)
    built: list[torch.nn.Module] = []

    def frozen_first_layer(spec):
        model = TinyMLP(spec)
        built.append(model)
        return model

    halved = train_reference(job, build_model=frozen_first_layer,
                             build_optimizer=lambda master: torch.optim.SGD(master.parameters(), lr=job.lr / 2))
    assert built and halved.optimizer == "SGD"
    assert halved.losses[0] == default.losses[0] and halved.losses[1] != default.losses[1]
