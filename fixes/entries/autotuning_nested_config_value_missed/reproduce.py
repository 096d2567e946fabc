"""How autotuning-nested-config-value-missed is reproduced: the fast check the release sweep runs (``reproduce()``:
True where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix
or its probe.

Running the autotuner itself (``deepspeed --autotuning run``) launches every experiment through the ``deepspeed``
launcher (pdsh, one process group per experiment, on GPUs) and ``Autotuner`` needs ``tabulate``: neither is used
here. The user's job goes through the DeepSpeed functions the autotuner calls instead, with their own code:

* the launcher's argument parser (``deepspeed.launcher.runner.parse_args``) and the ``ResourceManager`` that
  ``Autotuner._get_resource_manager`` builds (one node, one GPU slot, ``arg_mappings`` from the user's config);
* an experiment as ``Autotuner.run_tuning_micro_batch_sizes`` writes it (fast mode tunes the micro batch size of
  each ZeRO stage this way; :func:`micro_batch_experiment` has its lines), or as ``model_info_profile_run`` writes
  its profile run (:func:`profile_experiment`);
* ``ResourceManager.schedule_experiments``, ``resource_request`` and ``run_job``, which writes the experiment's
  values into the script's arguments (``get_val_by_key`` per ``arg_mappings`` key) and starts
  ``scheduler.run_experiment`` in a thread. That launch alone is replaced (:func:`launches_recorded`): it records
  the command ``run_experiment`` builds (its ``--deepspeed_config`` argument replaced by the experiment's config in
  base64, as it does) instead of starting ``deepspeed``.

What the user's script (:mod:`.script`) makes of that command is the symptom: the ZeRO stage it runs at.
"""
from __future__ import annotations

import base64
import contextlib
import copy
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

from ...exceptions import CannotTellError
from . import script

SCRIPT = "train.py"
CONFIG_FILE = "ds_config.json"
ARG_MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size", "stage": "--zero_stage"}
USER_ARGS = ["--deepspeed_config", CONFIG_FILE, "--per_device_train_batch_size", "1"]  # no --zero_stage: 0
TUNED_STAGE, TUNED_MICRO_BATCH = 3, 8


def user_config(zero_first: bool = False) -> dict[str, Any]:
    """The user's ds_config.json: the ZeRO stages to tune ([2, 3], as the autotuning README shows), precision
    switches before them, and the autotuning section with its arg_mappings. ``zero_first``: the
    zero_optimization section moved before every other section that is a dict."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "fp16": {"enabled": False, "loss_scale": 128, "initial_scale_power": 7},
        "bf16": {"enabled": False},
        "zero_optimization": {"stage": [2, 3]},
        "zero_force_ds_cpu_optimizer": False,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 0.0,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
        "autotuning": {"enabled": True, "fast": True, "arg_mappings": dict(ARG_MAPPINGS)},
    }
    if zero_first:
        config = {"zero_optimization": config.pop("zero_optimization"), **config}
    return config


def launcher_args(user_args: list[str] | None = None) -> Any:
    """``deepspeed --autotuning run --num_gpus 1 train.py USER_ARGS``, as the launcher parses it."""
    from deepspeed.launcher import runner

    return runner.parse_args(["--autotuning", "run", "--num_gpus", "1", SCRIPT, *(USER_ARGS if user_args is None
                                                                                    else user_args)])


def micro_batch_experiment(config: dict[str, Any], stage: int, micro_batch: int, hostfile: str = "") -> dict[str, Any]:
    """The experiment ``Autotuner.run_tuning_micro_batch_sizes`` writes for ``stage`` and ``micro_batch`` on one GPU
    of one node (``max_train_batch_size_per_gpu`` = the micro batch: gradient_accumulation_steps 1)."""
    from deepspeed.autotuning.constants import TUNING_MICRO_BATCH_SIZE_PREFIX
    from deepspeed.autotuning.utils import get_first_config

    num_gpus = num_nodes = mp_size = 1
    ds_config = get_first_config(config)
    ds_config["zero_optimization"] = {"stage": stage}
    gas = micro_batch // micro_batch
    ds_config["train_micro_batch_size_per_gpu"] = micro_batch
    ds_config["gradient_accumulation_steps"] = gas
    ds_config["train_batch_size"] = micro_batch * gas * num_gpus * num_nodes // mp_size
    name = TUNING_MICRO_BATCH_SIZE_PREFIX + str(stage) + "_gas" + str(gas) + "_tmbspg" + str(micro_batch)
    return {"name": name, "ds_config": ds_config, "num_gpus": num_gpus, "num_nodes": num_nodes,
            "hostfile": hostfile or launcher_args().hostfile}


def profile_experiment(config: dict[str, Any], hostfile: str = "") -> dict[str, Any]:
    """The model-info profile run ``Autotuner.model_info_profile_run`` writes first (``DEFAULT_MIN_MEM_CONFIG``:
    ZeRO-3, micro batch 1)."""
    from deepspeed.autotuning.constants import DEFAULT_MIN_MEM_CONFIG
    from deepspeed.autotuning.utils import replace_dict

    ds_config = copy.deepcopy(config)
    replace_dict(ds_config, DEFAULT_MIN_MEM_CONFIG)
    ds_config["autotuning"] = {"enabled": True, "model_info_path": "profile_model_info/model_info.json",
                               "model_info": {"profile": True}}
    return {"name": "profile_model_info", "ds_config": ds_config, "num_gpus": 1, "num_nodes": 1,
            "hostfile": hostfile or launcher_args().hostfile}


@dataclass(frozen=True)
class Launch:
    """One experiment as ``run_experiment`` would launch it: ``deepspeed train.py script_args``."""

    name: str
    ds_config: dict[str, Any]  # the experiment's config (what --deepspeed_config carries, base64)
    script_args: list[str]

    @property
    def shown(self) -> str:
        """The command, with the base64 config abbreviated."""
        args = list(self.script_args)
        if "--deepspeed_config" in args:
            args[args.index("--deepspeed_config") + 1] = "<the experiment's ds_config, base64>"
        return " ".join(["deepspeed", SCRIPT, *args])

    @property
    def args(self) -> Any:
        """What the user's script parses from the command."""
        return script.parse_args(self.script_args)


@contextlib.contextmanager
def launches_recorded() -> Iterator[list[Launch]]:
    """``deepspeed.autotuning.scheduler.run_experiment`` (the thread ``run_job`` starts) replaced by one that
    records the command it would launch: the script's arguments with ``--deepspeed_config`` set to the
    experiment's config in base64, as ``run_experiment`` sets it. The original is put back on exit."""
    from deepspeed.autotuning import scheduler

    launched: list[Launch] = []

    def run_experiment(exp, reservations, user_script, user_args):
        args = list(user_args)
        if "--deepspeed_config" in args:
            encoded = base64.urlsafe_b64encode(json.dumps(exp["ds_config"]).encode("utf-8")).decode("utf-8")
            args[args.index("--deepspeed_config") + 1] = encoded
        launched.append(Launch(exp["name"], copy.deepcopy(exp["ds_config"]), args))

    original = scheduler.run_experiment
    scheduler.run_experiment = run_experiment
    try:
        yield launched
    finally:
        scheduler.run_experiment = original


def schedule(exp: dict[str, Any], config: dict[str, Any] | None = None, user_args: list[str] | None = None,
             workdir: str | None = None) -> Launch:
    """``exp`` through the autotuner's ``ResourceManager`` (written to its experiments directory, scheduled,
    given a GPU slot, ``run_job``): the launch ``run_job`` starts."""
    from deepspeed.autotuning.config import DeepSpeedAutotuningConfig
    from deepspeed.autotuning.scheduler import ResourceManager

    config = user_config() if config is None else config
    with contextlib.ExitStack() as stack:
        workdir = workdir or stack.enter_context(tempfile.TemporaryDirectory())
        exps_dir, results_dir = os.path.join(workdir, "autotuning_exps"), os.path.join(workdir, "autotuning_results")
        os.makedirs(exps_dir, exist_ok=True)
        rm = ResourceManager(args=launcher_args(user_args), hosts=["localhost"], num_gpus_per_node=1,
                             results_dir=results_dir, exps_dir=exps_dir,
                             arg_mappings=DeepSpeedAutotuningConfig(config).arg_mappings)
        path = os.path.join(exps_dir, f"{exp['name']}.json")
        with open(path, "w") as file:
            json.dump(exp, file)
        rm.schedule_experiments([path])
        scheduled = rm.experiment_queue.pop(0)
        reservations = rm.resource_request(scheduled)
        with launches_recorded() as launched:
            rm.run_job(scheduled, reservations)
            thread = rm.running_experiments[scheduled["exp_id"]][0]
            thread.join(timeout=60)
        if len(launched) != 1:
            raise CannotTellError(f"run_job launched {len(launched)} experiments for one: {launched}")
        return launched[0]


def runs_at_another_stage(exp: dict[str, Any], config: dict[str, Any] | None = None) -> bool:
    """Does the user's script, given the command the autotuner launches ``exp`` with, run at another ZeRO stage
    than the experiment's config says?"""
    launch = schedule(exp, config)
    return launch.args.zero_stage != exp["ds_config"]["zero_optimization"]["stage"]


def reproduce() -> bool:
    """The ZeRO-3 micro-batch experiment (micro batch 8) of the user's config through ``run_job``: True if its
    command lacks ``--zero_stage 3`` (the script runs at its default, 0), False if it has it; CannotTellError if
    the top-level mapping (the micro batch) is missing too, or the stage is neither."""
    launch = schedule(micro_batch_experiment(user_config(), TUNED_STAGE, TUNED_MICRO_BATCH))
    args = launch.args
    if args.per_device_train_batch_size != TUNED_MICRO_BATCH:
        raise CannotTellError(f"the micro batch was not passed either: {launch.shown}")
    if args.zero_stage == TUNED_STAGE:
        return False
    if args.zero_stage == 0 and "--zero_stage" not in launch.script_args:
        return True
    raise CannotTellError(f"the command gives ZeRO stage {args.zero_stage}: {launch.shown}")


def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``), each cell :func:`runs_at_another_stage` for the config of one
    experiment of the user's config (fp16 and bf16 sections before zero_optimization, ``"stage"`` mapped to
    ``--zero_stage``): the ZeRO-3 micro-batch experiment (the sweep's check), the ZeRO-2 and ZeRO-1 ones, the
    model-info profile run (ZeRO-3, micro batch 1), then the ZeRO-0 experiment: its stage, 0, is never written into
    the arguments (``run_job`` skips a falsy value, with the fix too) and is what the script runs at by default.

    Not in the grid, because ``fixes.trigger`` reads no autotuning section and no order of sections: the same
    experiments with zero_optimization first in the user's config (found, not hit), an experiment from the ZeRO
    tuning spaces (``Autotuner._generate_experiments`` starts each config from a template whose first section is
    zero_optimization: found, not hit), and keys at the top of the config (the micro batch: found on every release).
    The trigger's note states them."""
    from ...harness import Cell, trigger_job

    config = user_config()

    def cell(label: str, exp: dict[str, Any], flips: str = "") -> Cell:
        return Cell(label, trigger_job(exp["ds_config"], 1), lambda: runs_at_another_stage(exp, config), flips)

    return [cell("ZeRO-3 micro-batch experiment, stage mapped to --zero_stage, fp16/bf16 sections first",
                 micro_batch_experiment(config, TUNED_STAGE, TUNED_MICRO_BATCH)),
            cell("the ZeRO-2 experiment instead", micro_batch_experiment(config, 2, TUNED_MICRO_BATCH)),
            cell("the ZeRO-1 experiment instead", micro_batch_experiment(config, 1, TUNED_MICRO_BATCH)),
            cell("the model-info profile run (ZeRO-3, micro batch 1)", profile_experiment(config)),
            cell("the ZeRO-0 experiment: stage 0 is never passed and is the script's default",
                 micro_batch_experiment(config, 0, TUNED_MICRO_BATCH), "zero_stage")]
