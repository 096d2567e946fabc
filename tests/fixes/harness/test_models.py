"""Tiny models: the same weights wherever they are built."""
import torch

from fixes.harness.models import ModelSpec, SeededLinear, TinyMLP, cpu_initial_values


def test_when_built_on_cpu_then_seeded_linear_is_torch_linear_bit_for_bit_and_prints_as_linear():
    torch.manual_seed(3)
    plain = torch.nn.Linear(8, 16)
    torch.manual_seed(3)
    seeded = SeededLinear(8, 16)
    assert torch.equal(plain.weight, seeded.weight) and torch.equal(plain.bias, seeded.bias)
    assert repr(seeded) == repr(plain)


def test_when_values_are_drawn_for_another_device_then_they_are_what_linear_draws_on_cpu():
    # What SeededLinear copies into parameters made off the CPU (deepspeed.zero.Init on CUDA).
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(5)
        plain = torch.nn.Linear(8, 16, dtype=dtype)
        after_plain = torch.rand(1)
        torch.manual_seed(5)
        weight, bias = cpu_initial_values(torch.empty(16, 8, dtype=dtype, device="meta"),
                                          torch.empty(16, dtype=dtype, device="meta"))
        assert weight.device.type == "cpu" and weight.dtype == dtype
        assert torch.equal(weight, plain.weight) and torch.equal(bias, plain.bias)
        assert torch.equal(torch.rand(1), after_plain)  # the generator advanced as Linear's own call does


def test_when_a_parameter_is_made_off_the_cpu_then_seeded_linear_takes_the_cpu_values(monkeypatch):
    copied = {}
    monkeypatch.setattr(torch.Tensor, "copy_", lambda self, src, *a, **k: copied.setdefault(tuple(self.shape), src))
    torch.manual_seed(0)
    SeededLinear(8, 16, device="meta")
    torch.manual_seed(0)
    plain = torch.nn.Linear(8, 16)
    assert torch.equal(copied[(16, 8)], plain.weight) and torch.equal(copied[(16,)], plain.bias)


def test_when_the_mlp_is_built_twice_then_its_weights_are_equal_and_the_callers_generator_is_untouched():
    torch.manual_seed(11)
    expected_next = torch.rand(1)
    torch.manual_seed(11)
    first, second = TinyMLP(ModelSpec(seed=2)), TinyMLP(ModelSpec(seed=2))
    assert torch.equal(torch.rand(1), expected_next)
    assert all(torch.equal(a, b) for a, b in zip(first.parameters(), second.parameters()))
