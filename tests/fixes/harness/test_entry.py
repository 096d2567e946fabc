"""harness.begin: the probe against the measured matrix, which is measured on CPU."""
import pytest

import fixes
from fixes.fix import Probe
from fixes.harness import entry as entry_module
from fixes.harness.env import Environment

ENTRY = "zero12-cpu-no-allreduce-noncontiguous"  # a bug of DeepSpeed's CPU-only code path
RELEASE = "0.18.2"  # measured affected (on CPU)


def _begin(monkeypatch, accelerator):
    env = Environment("3.12.3", "2.11.0", RELEASE, "/ds", "/fixes", accelerator, "GPU or CPU", 1, 0)
    monkeypatch.setattr(entry_module, "setup", lambda seed=0: env)
    fix = fixes.get(ENTRY)
    monkeypatch.setattr(type(fix), "probe", lambda self: Probe(False, "the CUDA tensor types pass the check"))
    assert fix.info.expected_affected(RELEASE) is True
    return entry_module.begin(ENTRY)


def test_when_the_probe_disagrees_with_the_matrix_on_cpu_then_begin_fails():
    with pytest.MonkeyPatch.context() as monkeypatch, pytest.raises(AssertionError, match="measured affected=True"):
        _begin(monkeypatch, "cpu")


def test_when_the_probe_disagrees_on_cuda_then_begin_says_so_and_the_notebook_follows_the_probe(capsys):
    with pytest.MonkeyPatch.context() as monkeypatch:
        started = _begin(monkeypatch, "cuda")
    assert started.affected is False
    assert "the probe on cuda says affected=False; the matrix was measured on CPU" in capsys.readouterr().out
