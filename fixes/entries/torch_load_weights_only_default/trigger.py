"""The jobs that hit this entry's bug (``fixes.trigger``): measured by its ``reproduce.trigger_cells()``.

The bug needs a torch whose ``torch.load`` loads with ``weights_only=True`` where the caller passes none (torch 2.6 or
newer): :mod:`fixes.trigger` has ``torch_below`` only, so the condition "torch 2.6 or newer" is stated here as its
negation (open where the job's torch is not known). Then a checkpoint with an optimizer file of DeepSpeed's (ZeRO
stage 1-3, or the BF16 optimizer under stage 0) read back by ``load_checkpoint`` or zero_to_fp32.
"""
from ...trigger import Condition, Trigger, any_of, precision, stage, torch_below, uses

_BELOW_2_6 = torch_below("2.6")


def _torch_at_least_2_6(job):  # noqa: ANN001, ANN202 - a Condition's test
    below = _BELOW_2_6(job)
    return None if below is None else not below


TRIGGER = Trigger(Condition("torch >= 2.6 (torch.load defaults to weights_only=True)", _torch_at_least_2_6, "torch"),
                  any_of(stage(1, 2, 3), precision("bf16")),
                  any_of(uses("checkpoint-resume"), uses("zero-to-fp32")),
                  note="unless TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1 is set; ZeRO stage 0 in fp16 is not measured")
