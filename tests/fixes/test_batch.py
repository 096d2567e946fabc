"""fixes.batch: the three batch sizes of a DeepSpeed config resolved as DeepSpeed resolves them, on configs in the shapes
users have them, held to DeepSpeed's own ``_set_batch_related_parameters`` / ``_batch_assertion`` of an installed
release; and ``fixbook doctor --config`` refusing a combination DeepSpeed rejects.

The configs under data/configs:

* ``hf_trainer_zero3_auto.json``: a Hugging Face Trainer ZeRO-3 config, every batch value ``"auto"``;
* ``megatron_gpt_zero3.json``: Megatron-DeepSpeed's examples_deepspeed/universal_checkpointing/megatron_gpt/ds_config.json
  (train 16, micro 4, no accumulation steps);
* ``megatron_train16_micro16.json``: a Megatron-DeepSpeed config whose global and micro batch are both 16;
* ``cifar10_tutorial.json``: the ds_config.json of DeepSpeed's CIFAR-10 tutorial (docs/_tutorials/cifar-10.md),
  ``train_batch_size`` only;
* ``zenflow_zero2_offload.json``: DeepSpeedExamples' training/DeepSpeed-ZenFlow/finetuning/zf_config.json (train 32,
  accumulation 1, explicit).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ci import releases
from fixes import batch
from fixes.trigger import job_from_config
from tests.helpers import call_in_release

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"


def _config(name: str) -> dict:
    return json.loads((CONFIGS / name).read_text())


@pytest.mark.parametrize("name, world_size, expected", [
    ("megatron_gpt_zero3.json", 4, (16, 4, 1)),
    ("megatron_gpt_zero3.json", 2, (16, 4, 2)),
    ("megatron_train16_micro16.json", 1, (16, 16, 1)),
    ("cifar10_tutorial.json", 1, (4, 4, 1)),
    ("cifar10_tutorial.json", 2, (4, 2, 1)),
    ("zenflow_zero2_offload.json", 8, (32, 4, 1)),
])
def test_when_a_config_is_possible_then_its_batch_sizes_are_deepspeeds(name, world_size, expected) -> None:
    sizes = batch.from_config(_config(name), world_size)
    assert (sizes.train, sizes.micro, sizes.gas) == expected and not sizes.rejected
    assert job_from_config(_config(name), world_size).gradient_accumulation_steps == expected[2]


@pytest.mark.parametrize("name, world_size, message", [
    ("megatron_train16_micro16.json", 8, "Gradient accumulation steps: 0 has to be greater than 0"),
    ("megatron_gpt_zero3.json", 8, "Gradient accumulation steps: 0 has to be greater than 0"),
    ("cifar10_tutorial.json", 8, "Micro batch size per gpu: 0 has to be greater than 0"),
    ("cifar10_tutorial.json", 3, "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * "
                                 "world_size 4 != 1 * 1 * 3"),
    ("zenflow_zero2_offload.json", 3, "32 != 10 * 1 * 3"),
])
def test_when_deepspeed_would_reject_the_combination_then_the_job_has_no_batch_values(name, world_size, message) -> None:
    sizes = batch.from_config(_config(name), world_size)
    assert sizes.rejected and message in sizes.error and batch.RULE in sizes.error
    assert (sizes.train, sizes.micro, sizes.gas) == (None, None, None)
    assert job_from_config(_config(name), world_size).gradient_accumulation_steps is None


def test_when_the_values_are_auto_then_they_stay_open_as_hugging_face_leaves_them() -> None:
    sizes = batch.from_config(_config("hf_trainer_zero3_auto.json"), 8)
    assert (sizes.train, sizes.micro, sizes.gas, sizes.rejected) == (None, None, None, False)
    assert set(sizes.auto) == set(batch.KEYS) == set(sizes.open)
    explicit = batch.resolve("auto", "auto", 4, 8)  # an explicit value among "auto" ones is known
    assert (explicit.gas, explicit.open) == (4, (batch.TRAIN, batch.MICRO))


def test_when_the_data_parallel_size_is_unknown_then_only_what_it_does_not_decide_is_given() -> None:
    assert batch.from_config(_config("megatron_gpt_zero3.json"), None).open == (batch.GAS,)
    assert batch.resolve(16, 4, 2, None).gas == 2  # every size-free value is known
    assert batch.resolve(4, None, None, None).gas == 1  # DeepSpeed's own default with train_batch_size alone
    assert "no data-parallel size satisfies it" in batch.resolve(16, 3, None, None).error
    assert batch.resolve(None, None, 4, None).incomplete
    assert "whole number" in batch.resolve("16", 4, None, 2).error


def check_deepspeeds_own_batch_rule_on_every_combination():
    """DeepSpeed's DeepSpeedConfig batch methods over the combinations, printed as JSON (one object per line)."""
    import json as json_

    from deepspeed.runtime.config import DeepSpeedConfig

    for train, micro, gas, world in COMBINATIONS:
        config = object.__new__(DeepSpeedConfig)  # only the batch methods run: no process group is needed
        config.train_batch_size, config.train_micro_batch_size_per_gpu = train, micro
        config.gradient_accumulation_steps, config.world_size = gas, world
        try:
            config._configure_train_batch_size()
        except AssertionError as exc:
            result = {"error": str(exc)}
        else:
            result = {"sizes": [config.train_batch_size, config.train_micro_batch_size_per_gpu,
                                config.gradient_accumulation_steps]}
        print("COMBINATION " + json_.dumps([train, micro, gas, world, result]))


# Every given/missing pattern of the three values, possible and impossible, on several data-parallel sizes.
COMBINATIONS = [(t, m, g, w) for w in (1, 2, 3, 8)
                for t, m, g in [(16, 16, None), (16, 4, None), (16, None, None), (None, 4, None), (16, 4, 2), (16, 2, 2),
                                (16, None, 2), (None, 4, 2), (None, None, 2), (None, None, None), (4, None, None),
                                (32, 4, 1), (24, 4, None), (16, 16, 1), (0, 4, None), (6, None, 4)]]


@pytest.mark.parametrize("release", ["0.16.0", "0.19.8"])
def test_when_deepspeed_itself_resolves_each_combination_then_the_fixbook_resolves_it_the_same(release) -> None:
    out = call_in_release(release, check_deepspeeds_own_batch_rule_on_every_combination)
    measured = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("COMBINATION ")]
    assert len(measured) == len(COMBINATIONS)
    rejected = 0
    for train, micro, gas, world, theirs in measured:
        ours = batch.resolve(train, micro, gas, world)
        if "error" in theirs:
            rejected += 1
            assert ours.rejected and theirs["error"] in ours.error, (train, micro, gas, world, theirs, ours)
        else:
            assert [ours.train, ours.micro, ours.gas] == theirs["sizes"] and not ours.rejected, (
                train, micro, gas, world, theirs, ours)
    assert 0 < rejected < len(measured)  # the table holds both kinds


def _doctor(release: str, config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **releases.environment(release)}
    return subprocess.run([sys.executable, "-m", "fixes.cli", "doctor", "--config", str(config), *args],
                          capture_output=True, text=True, env=env, timeout=300)


def test_when_doctor_gets_a_combination_deepspeed_rejects_then_it_exits_non_zero_naming_the_rule() -> None:
    done = _doctor("0.19.8", CONFIGS / "megatron_train16_micro16.json", "--world-size", "8")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Gradient accumulation steps: 0 has to be greater than 0" in done.stderr
    assert batch.RULE in done.stderr and "gradient_accumulation_steps 0" not in done.stdout + done.stderr
    possible = _doctor("0.19.8", CONFIGS / "megatron_train16_micro16.json", "--world-size", "1")
    assert possible.returncode == 0 and "gradient_accumulation_steps 1, 1 ranks" in possible.stdout, possible.stderr
    unknown = _doctor("0.19.8", CONFIGS / "megatron_gpt_zero3.json")
    assert unknown.returncode == 0 and "gradient_accumulation_steps ?" in unknown.stdout
    assert "state it with --world-size" in unknown.stdout
