"""Whole-model torch.func helpers that need no DeepSpeed: transforms on the plain model, and how a
child's failure is classified."""
import pytest
import torch

from fixes.exceptions import RankFailedError
from fixes.harness import TinyMLP, mse
from fixes.entries.zero3_hooks_torch_func.func_transforms import (CaseOutcome, DemoResult, FuncCase, apply_transform,
                                                                  rank_inputs, zero3_func_job)


def test_when_transforms_run_on_the_plain_model_then_they_match_autograd():
    job = zero3_func_job()
    model = TinyMLP(job.model)
    x, y = rank_inputs(job, 1, 0)
    x_ref = x.clone().requires_grad_()
    mse(model(x_ref), y).backward()
    torch.testing.assert_close(apply_transform("grad", model, x, y)["grad"], x_ref.grad)
    per_sample = apply_transform("vmap_grad", model, x, y)["per_sample_grad"]
    assert per_sample.shape == x.shape
    params = apply_transform("param_grad", model, x, y)
    model.zero_grad()
    mse(model(x), y).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(params[f"d/d {name}"], param.grad)


def test_when_unknown_transform_requested_then_value_error():
    with pytest.raises(ValueError, match="unknown transforms"):
        FuncCase(zero3_func_job(), transforms=("hessian", ))


@pytest.mark.parametrize(("exc_type", "message", "trace", "symptom"), [
    ("ProcessDied", "the process died (SIGSEGV) without reporting", "", "SIGSEGV"),
    ("RuntimeError", "In order to use ... it must override the setup_context staticmethod.", "", "setup_context error"),
    ("RuntimeError", "level.has_value() && level <= current_level INTERNAL ASSERT FAILED at x escaped?", "",
     "functorch level assert"),
    ("AttributeError", "'Tensor' object has no attribute 'ds_status'", "", "ds_status AttributeError"),
    ("RuntimeError", "Cannot access data pointer of Tensor that doesn't have storage", "in reset_step",
     "no-storage error in reset_step"),
    ("ValueError", "something else", "", None),
])
def test_when_a_child_fails_then_the_symptom_is_named(exc_type, message, trace, symptom):
    error = RankFailedError(0, exc_type, message, trace)
    assert CaseOutcome(FuncCase(zero3_func_job()), 1, error=error).symptom == symptom


def test_when_frames_in_traceback_then_the_innermost_deepspeed_ones_are_shown():
    trace = ('  File "/x/deepspeed/runtime/zero/parameter_offload.py", line 380, in _post_backward_module_hook\n'
             '  File "/x/torch/autograd/function.py", line 628, in apply\n'
             '  File "/x/deepspeed/runtime/zero/utils.py", line 176, in apply_to_tensors_only\n')
    outcome = CaseOutcome(FuncCase(zero3_func_job()), 1, error=RankFailedError(0, "RuntimeError", "m", trace))
    assert outcome.failing_frame == ("deepspeed/runtime/zero/parameter_offload.py:380 in _post_backward_module_hook"
                                     " -> deepspeed/runtime/zero/utils.py:176 in apply_to_tensors_only")


@pytest.mark.parametrize(("returncode", "output", "ended"), [
    (-11, "after ... = True", "killed by SIGSEGV"),
    (1, "after ... = True\nTraceback (most recent call last):\n...\nRuntimeError: escaped?",
     "exit code 1: RuntimeError: escaped?"),
    (0, "after ... = True\ntorch.func.grad returned", "exit code 0"),
])
def test_when_the_demo_child_ends_then_ended_says_how(returncode, output, ended):
    assert DemoResult(returncode, output).ended == ended
