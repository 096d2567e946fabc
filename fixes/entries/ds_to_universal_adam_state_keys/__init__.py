"""Fix for ds-to-universal-adam-state-keys: the ZeRO-1/2 half of upstream PR #8609 (open), which makes
``deepspeed.checkpoint.ds_to_universal`` follow the optimizer's own state names instead of Adam's.

Two module-level functions of ``ds_to_universal`` name Adam's state, each in one place; the fix recompiles each
from the installed release's own source with that one place changed (:func:`fixes.patching.recompiled`: the
module's globals, the installed file's line numbers, ``__wrapped__`` the original), and refuses with
``DriftError`` unless the text it changes occurs exactly once:

* ``extract_zero_shards`` (step 1, "Extracting ZeRO fragments"): ``flat_state`` is built from the parameter
  group's own saved state, every tensor in it but ``step`` (which the function already handles on its own), plus
  ``fp32``. For Adam that is ``exp_avg``, ``exp_avg_sq`` and ``fp32``, as before; for torch's SGD without momentum
  ``fp32`` alone, with momentum also ``momentum_buffer``.
* ``merge_tp_slices`` (step 2, "Merging slices"): the states merged are ``fp32`` and those whose fragment files
  step 1 wrote for the parameter, in sorted order (for Adam ``exp_avg``, ``exp_avg_sq``: the same three, in the
  same order, as before).

The ZeRO-1/2 loader (``load_hp_checkpoint_state``, used by ``"checkpoint": {"load_universal": true}``) already
reads whichever state files the parameter's folder holds, so it needs no change (as the PR says). ZeRO-3's
extraction, merge and loader name Adam's state too; the PR changes them, this fix does not (the Fixbook measured
the ZeRO-1/2 path only; ``extract_zero_shards_stage3`` is also entry ds-to-universal-zero3-sub-groups' target).

Both functions are looked up in the module when ``main`` calls them (directly, or through
``functools.partial`` in its worker pools, forked on Linux before Python 3.14), so ``ds_to_universal.main`` run in
this process after ``fixes.apply`` converts with the fix; ``python -m deepspeed.checkpoint.ds_to_universal`` in
another process does not (call ``main`` after ``fixes.apply``, as the notebook shows).

The probe reads both functions' source: affected where ``extract_zero_shards`` reads ``exp_avg`` by name or
``merge_tp_slices`` loops over the fixed tuple ``("fp32", "exp_avg", "exp_avg_sq")``.
"""
from __future__ import annotations

import inspect
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, edited_source, recompiled

_MODULE = "deepspeed.checkpoint.ds_to_universal"
_EXTRACT = Target(_MODULE, "extract_zero_shards")
_MERGE = Target(_MODULE, "merge_tp_slices")
_LABEL = "ds-to-universal-adam-state-keys"

# extract_zero_shards, as every affected release has it, and the same five lines naming the group's own states
_ADAM_STATE = '''\
        flat_state = dict(
            exp_avg=state_groups[param_group_id]["exp_avg"],
            exp_avg_sq=state_groups[param_group_id]["exp_avg_sq"],
            fp32=fp32_groups[param_group_id],
        )
'''
_OWN_STATE = '''\
        flat_state = {  # the optimizer's own state names (Adam: exp_avg, exp_avg_sq); step is handled below
            key: value for key, value in state_groups[param_group_id].items()
            if key != "step" and torch.is_tensor(value)
        }
        flat_state["fp32"] = fp32_groups[param_group_id]
'''
# merge_tp_slices: the states to merge, from the fragment files extract_zero_shards wrote for the parameter
_ADAM_MERGE = '    for state in ("fp32", "exp_avg", "exp_avg_sq"):\n'
_OWN_MERGE = ('    for state in ["fp32"] + sorted({os.path.basename(p).rsplit(".", 1)[0] for p in glob.glob('
              'os.path.join(slice_base_path, "*", "*.*"))} - {"fp32", "step"}):\n')


class DsToUniversalAdamStateKeys(Fix):
    targets = (_EXTRACT, _MERGE)

    def read_code(self) -> Probe:
        extract, merge = inspect.getsource(_EXTRACT.code()), inspect.getsource(_MERGE.code())
        found = []
        if 'state_groups[param_group_id]["exp_avg"]' in extract:
            found.append("extract_zero_shards reads each parameter group's saved optimizer state as "
                         "state_groups[param_group_id][\"exp_avg\"] and [\"exp_avg_sq\"]")
        if _ADAM_MERGE in merge:
            found.append('merge_tp_slices merges the states ("fp32", "exp_avg", "exp_avg_sq") whatever the '
                         "optimizer saved")
        if found:
            return Probe(True, "; ".join(found))
        return Probe(False, "extract_zero_shards and merge_tp_slices do not name Adam's state")

    def patches(self) -> list[AttributePatch]:
        return [_EXTRACT.wrap(lambda original: _rewritten(original, _EXTRACT, _ADAM_STATE, _OWN_STATE)),
                _MERGE.wrap(lambda original: _rewritten(original, _MERGE, _ADAM_MERGE, _OWN_MERGE))]


def _rewritten(original: Any, target: Target, old: str, new: str) -> Any:
    return recompiled(original, edited_source(original, old, new, target.dotted), _LABEL)


FIX = DsToUniversalAdamStateKeys()
