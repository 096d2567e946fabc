"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug is in how the autotuner (``deepspeed --autotuning run`` / ``tune``) passes an experiment's values to the
user's script: the experiment's config (the job here) has its ``autotuning`` section enabled, and a ZeRO stage above 0
(a tuned stage of 0 is never passed on: ``run_job`` skips a value that is falsy, fixed or not). Which keys
``arg_mappings`` maps, and the order of the config's sections, are in the note: ``fixes.trigger`` reads neither.
"""
from ...trigger import Trigger, equals, stage

TRIGGER = Trigger(equals("autotuning", True, "run by the autotuner (\"autotuning\": {\"enabled\": true})"),
                  stage(1, 2, 3),
                  note="in an experiment of the autotuner whose autotuning.arg_mappings maps a key nested in a "
                       "config section (\"stage\" to the script's --zero_stage), where another section that is a "
                       "dict (fp16, bf16, optimizer...) comes before that one in the user's config; keys at the "
                       "top of the config (train_micro_batch_size_per_gpu) and a job run without the autotuner "
                       "are not hit")
