"""inference-config-moe-bool: on an affected release the fixed ``init_inference`` with a bool ``moe`` builds the
engine upstream's fix builds (``DeepSpeedMoEConfig(enabled=<bool>)``), whose outputs equal plain PyTorch's, leaves
the other forms of the setting as they were, and reaches a config built directly as well as through
``init_inference``; on the release upstream fixed, the same calls give the same configs with no fix."""
import json

import pytest

from tests.helpers import call_in_release

AFFECTED = "0.19.0"
FIXED_UPSTREAM = "0.19.3"
FIX_ID = "inference-config-moe-bool"
DTYPES = ("float32", "bfloat16")
MARK = "moe configs: "


def _moe_configs():
    """What ``DeepSpeedInferenceConfig`` makes of each form of the MoE setting (as a dict), or the error's type."""
    from deepspeed.inference.config import DeepSpeedInferenceConfig

    forms = {"True": True, "False": False, "dict": {"enabled": False, "ep_size": 1}, "unset": None}
    made = {}
    for label, moe in forms.items():
        try:
            config = DeepSpeedInferenceConfig() if moe is None else DeepSpeedInferenceConfig(moe=moe)
        except Exception as exc:  # noqa: BLE001 - recorded and compared
            made[label] = type(exc).__name__
        else:
            made[label] = config.moe.model_dump() if hasattr(config.moe, "model_dump") else config.moe
    return json.loads(json.dumps(made, default=str))  # as it crosses processes


def _verify_outputs():
    """init_inference with moe=True/False in each dtype: the engine's MoE setting, and its outputs against plain
    PyTorch within the dtype's tolerance."""
    import torch
    import deepspeed
    from deepspeed.inference.config import DeepSpeedMoEConfig

    from fixes import harness
    from fixes.entries.inference_config_moe_bool import reproduce as moe_bool

    for name in DTYPES:
        dtype = harness.dtype_of(name)
        for moe in (True, False):
            engine = deepspeed.init_inference(harness.TinyMLP(), moe=moe, dtype=dtype)
            assert isinstance(engine._config.moe, DeepSpeedMoEConfig) and engine._config.moe.enabled is moe
            with torch.no_grad():
                outputs = engine(moe_bool.inputs(dtype).to(harness.device())).cpu()
            harness.assert_close(outputs, moe_bool.reference_outputs(dtype), dtype, f"{name} moe={moe}")


def check_the_fix_matches_upstream_and_plain_pytorch(expected):
    import fixes
    from fixes import harness
    from fixes.entries.inference_config_moe_bool import reproduce as moe_bool

    harness.setup()
    before = _moe_configs()
    assert before["True"] == before["False"] == "ValidationError", before
    assert moe_bool.reproduce() is True
    [outcome] = fixes.apply(FIX_ID)
    assert outcome.action == "applied", outcome
    try:
        assert _moe_configs() == expected
        assert moe_bool.reproduce() is False
        assert not moe_bool.shows(False, as_config=True)
        _verify_outputs()
    finally:
        fixes.revert(FIX_ID)
    assert _moe_configs() == before
    assert moe_bool.reproduce() is True


def check_upstream(release):
    """What the release upstream fixed makes of each form (the fix is a no-op there), its outputs verified too."""
    import fixes
    from fixes import harness

    harness.setup()
    assert not fixes.get(FIX_ID).probe().affected
    made = _moe_configs()
    assert made["True"]["enabled"] is True and made["False"]["enabled"] is False, made
    _verify_outputs()
    print(MARK + json.dumps(made))


def test_when_applied_then_bool_moe_builds_upstreams_config_and_outputs_match_plain_pytorch():
    out = call_in_release(FIXED_UPSTREAM, check_upstream, args=(FIXED_UPSTREAM,))
    expected = json.loads([line for line in out.splitlines() if line.startswith(MARK)][-1][len(MARK):])
    call_in_release(AFFECTED, check_the_fix_matches_upstream_and_plain_pytorch, args=(expected,))


@pytest.mark.parametrize("release", [AFFECTED])
def test_when_the_validator_is_rebuilt_then_tracebacks_show_the_fixed_line(release):
    call_in_release(release, check_fixed_source_shown)


def check_fixed_source_shown():
    """While applied, the validator's source as inspect (and a traceback) reads it is upstream's fixed line, at the
    installed file's line number; after revert, the installed source again."""
    import inspect

    import fixes
    from fixes import harness
    from deepspeed.inference.config import DeepSpeedInferenceConfig

    harness.setup()
    function = vars(DeepSpeedInferenceConfig)["moe_backward_compat"].__func__
    installed = inspect.getsource(function)
    first_line = function.__code__.co_firstlineno
    fixes.apply(FIX_ID)
    try:
        shown = inspect.getsource(function)
        assert "DeepSpeedMoEConfig(enabled=field_value)" in shown and "moe=field_value" not in shown, shown
        assert function.__code__.co_firstlineno == first_line + 1  # the def line: the decorator is not compiled
    finally:
        fixes.revert(FIX_ID)
    assert inspect.getsource(function) == installed
