"""zero-grad-hook-lifetime on real PyTorch 2.0.1 (environment torch-2.0 of ci/environments.toml), no simulation.

The check runs in that environment's Python with DeepSpeed 0.17.6 (``environments.run_python``). An
environment that is not built fails the test, naming it: this is the entry's only real-torch check.
"""
import textwrap
from pathlib import Path

import pytest

from ci.releases import environments

CHECKS = str(Path(__file__).with_name("checks_torch_2_0.py"))  # imports no pytest: it runs in the environment

ENVIRONMENT = "torch-2.0"
RELEASE = "0.17.6"


def test_when_real_torch_2_0_then_backward_raises_index_error_on_empty_bucket_and_fix_matches_plain_sgd():
    try:
        env = environments.require(ENVIRONMENT)
    except environments.EnvironmentError_ as exc:
        pytest.fail(str(exc), pytrace=False)  # never skipped: the real-torch check must run
    code = textwrap.dedent(f"""
        import os, runpy, sys
        runpy.run_path({CHECKS!r})["check_real_torch_2_0_index_error_empty_bucket_then_fix_equals_plain_sgd"]()
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(0)
    """)
    done = environments.run_python(env, RELEASE, ["-c", code], timeout=600, capture_output=True, text=True)
    assert done.returncode == 0, (f"the check under {ENVIRONMENT} (torch {env.torch}) on DeepSpeed {RELEASE} failed "
                                  f"(exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    assert "real IndexError, empty bucket; fixed" in done.stdout


def test_when_environment_is_not_built_then_the_test_fails_naming_it(monkeypatch, tmp_path):
    monkeypatch.setattr(environments, "ENVS", tmp_path)
    with pytest.raises(environments.EnvironmentError_, match=f"environment {ENVIRONMENT} .* is not built"):
        environments.require(ENVIRONMENT)
