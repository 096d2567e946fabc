"""autotp-partition-config-path: the names AutoTP matches patterns against, on 0.18.8 (affected), 0.18.9 (upstream's
fix gives the same names) and 0.18.5 (no partition_config); AutoTP's own linear_policies path left alone."""
import pytest
import torch

import fixes
from fixes import harness
from tests.helpers import call_in_release

AFFECTED = "0.18.8"
FIX_ID = "autotp-partition-config-path"
UNSHARDED_NAMES = ["mlp.up_proj", "mlp.down_proj"] * 2
FULL_NAMES = ["layers.0.mlp.up_proj", "layers.0.mlp.down_proj", "layers.1.mlp.up_proj", "layers.1.mlp.down_proj"]


def _names_matched(with_config=True):
    """The name ``AutoTP._replace_module`` gives each layer it matches (``_replace_with_config`` replaced on the
    instance by a recorder), on the entry's model; without a partition config, the names ``linear_policies`` gets."""
    from deepspeed.module_inject.auto_tp import AutoTP
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from fixes.entries.autotp_partition_config_path.autotp import PARTITION_CONFIG, TinyDecoder

    names = []
    autotp = AutoTP(module=TinyDecoder(), all_reduce_linears=(), prefix="", state_dict=None,
                    linear_layer_setting=(torch.nn.Linear, torch.nn.Embedding), orig_layer_impl=None,
                    partition_config=AutoTPConfig.from_dict(PARTITION_CONFIG) if with_config else None)
    autotp._replace_with_config = lambda child, name: names.append(name)
    autotp.linear_policies = {torch.nn.Linear: lambda child, name, conv: names.append(name) or child}
    autotp._replace_module(autotp.module)
    return names


def check_the_patterns_see_the_whole_path_only_with_the_fix():
    harness.setup()
    assert _names_matched() == UNSHARDED_NAMES
    traditional = _names_matched(False)
    fixes.apply(FIX_ID)
    try:
        assert _names_matched() == FULL_NAMES
        assert _names_matched(False) == traditional  # AutoTP's own linear_policies path is left alone
    finally:
        fixes.revert(FIX_ID)


def check_unaffected_release(evidence: str, names: list | None):
    harness.setup()
    assert evidence in fixes.get(FIX_ID).probe().evidence
    assert [o.action for o in fixes.apply(FIX_ID)] == ["not needed"] and fixes.get(FIX_ID).reproduce() is False
    if names is not None:
        assert _names_matched() == names


def test_when_applied_then_the_patterns_see_the_whole_path_and_the_linear_policies_path_is_unchanged():
    call_in_release(AFFECTED, check_the_patterns_see_the_whole_path_only_with_the_fix)


@pytest.mark.parametrize(("release", "evidence", "names"), [("0.18.9", "passes full_name down", FULL_NAMES),
                                                            ("0.18.5", "no partition_config branch", None)])
def test_when_release_passes_the_full_name_down_or_has_no_patterns_then_not_affected(release, evidence, names):
    call_in_release(release, check_unaffected_release, args=(evidence, names))
