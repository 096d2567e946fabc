"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug is in how the autotuner (``deepspeed --autotuning run`` / ``tune``) passes an experiment's values to the
user's script, which no DeepSpeed config field that ``fixes.trigger`` reads shows: the ZeRO stage of the experiment
(its config is the job here) is the only condition the trigger can read. A tuned stage of 0 is never passed on
(``run_job`` skips a value that is falsy, fixed or not). The rest is in the note.
"""
from ...trigger import Trigger, stage

TRIGGER = Trigger(stage(1, 2, 3),
                  note="in an experiment of the autotuner whose autotuning.arg_mappings maps a key nested in a "
                       "config section (\"stage\" to the script's --zero_stage), where another section that is a "
                       "dict (fp16, bf16, optimizer...) comes before that one in the user's config; keys at the "
                       "top of the config (train_micro_batch_size_per_gpu) and a job run without the autotuner "
                       "are not hit")
