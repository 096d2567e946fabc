"""Fix for ds-to-universal-zero3-sub-groups: replaces two functions of ``deepspeed.checkpoint.ds_to_universal``
(the conversion) and the ZeRO-3 optimizer's universal-checkpoint loader (the load).

* ``extract_zero_shards_stage3``: upstream PR #7585's loop, taken as it is. ``param_shapes`` is the list
  the model file stores, one ``{name: shape}`` dict per optimizer sub-group, and each sub-group's
  parameters are cut from that sub-group's own flat tensors: ``fp32_flat_groups[idx]`` and
  ``optimizer_state_dict['state'][idx]`` (``exp_avg``, ``exp_avg_sq``), the offset starting at 0 in each.
* ``_extract_zero_shard_files_stage3``: ``main`` merges the model file's list into one dict before it
  calls this function (its merge step needs only the names); the replacement reads the list again from
  the same model file (``_parse_model_states_stage3``, as ``main`` does) and hands it to the workers,
  which is what ``main`` passes after PR #7585. ``main`` and the merge step stay as they are.

Both are looked up in the module when called (``main`` calls ``_extract_zero_shard_files_stage3``, which
binds ``extract_zero_shards_stage3`` with ``functools.partial``), so patching the module attributes fixes
``main`` called in this process, and the ``--num_extract_workers`` processes it forks (the ``fork`` start
method, Linux's default before Python 3.14; a worker started fresh imports the unpatched module). It
cannot fix ``python -m deepspeed.checkpoint.ds_to_universal`` run in another process: call ``main`` after
``fixes.apply`` instead (the notebook shows how).

The load, which the same PR rewrote:

* ``DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3``, the ZeRO-3 optimizer's
  universal-checkpoint loader (``"checkpoint": {"load_universal": true}``, ``load_checkpoint``): on the affected
  releases it concatenates the parameters of ``param_shapes[0]`` only, fills ``fp32_partitioned_groups_flat[0]``
  and hands ``torch.optim.Optimizer.load_state_dict`` a state dict with every saved sub-group but an optimizer with
  one parameter, which raises ``ValueError: loaded state dict contains a parameter group that doesn't match the size
  of optimizer's group`` for a checkpoint with several sub-groups. The replacement is upstream PR #7585's loader
  (0.18.0), *corrected*: for each sub-group it reads every one of its parameters' ``fp32``, ``exp_avg`` and
  ``exp_avg_sq`` from ``zero/<name>/`` into that sub-group's flat tensor and Adam state, and it gives each
  sub-group **its own** ``step``: the saved ``state[sub_group]['step']`` (a separate tensor). PR #7585 assigns
  the one tensor ``state[0]['step']`` to every sub-group, and torch's Adam, which increments ``state['step']`` in
  place once per sub-group, then advances the shared count once per sub-group per optimizer step (the entry
  zero3-universal-resume-shared-adam-step, 0.18.0 on); the corrected loader does not, so on 0.16.0 - 0.17.6 this
  fix alone resumes as an uninterrupted run does. The sub-groups' parameter names come from the loader's own
  ``param_shapes`` argument (the engine's ``_get_zero_param_shapes()``: one ``{name: shape}`` per sub-group of
  this optimizer; the affected releases' optimizer has no ``param_names``, which PR #7585 added). The
  hyperparameters of each optimizer param group are taken from the saved one (``lr``, ``betas``...), as
  ``load_state_dict`` did; the NVMe-swap steps and the fp16 copies are the installed release's own (0.16.0 -
  0.16.3 and 0.16.4 - 0.17.6 differ in how they purge the swapped state).

The probe reads both functions' source: affected when ``extract_zero_shards_stage3`` indexes the flat groups and the
optimizer state with the constant 0 and never loops over ``param_shapes``, or when the loader fills
``fp32_partitioned_groups_flat[0]`` from ``param_shapes[0]`` alone.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.checkpoint.ds_to_universal"
_EXTRACT = Target(_MODULE, "extract_zero_shards_stage3")
_EXTRACT_FILES = Target(_MODULE, "_extract_zero_shard_files_stage3")
_STAGE3 = "deepspeed.runtime.zero.stage3"
_LOADER = Target(_STAGE3, "DeepSpeedZeroOptimizer_Stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3")


class DsToUniversalZero3SubGroups(Fix):
    targets = (_EXTRACT, _EXTRACT_FILES, _LOADER)

    def read_code(self) -> Probe:
        found = [probe for probe in (_read_extract(), _read_loader()) if probe.affected]
        if found:
            return Probe(True, "; ".join(probe.evidence for probe in found))
        return Probe(False, "; ".join(probe.evidence for probe in (_read_extract(), _read_loader())))

    def patches(self) -> list[AttributePatch]:
        module = import_target_module(_MODULE)
        return [_EXTRACT.wrap(lambda original: _every_sub_group(original, module)),
                _EXTRACT_FILES.wrap(lambda original: _with_sub_group_shapes(original, module)),
                _LOADER.wrap(_load_every_sub_group)]


def _read_extract() -> Probe:
    function = _EXTRACT.code()
    if _loops_over_param_shapes(function):
        return Probe(False, "extract_zero_shards_stage3 loops over param_shapes, one flat tensor per sub-group")
    if "['fp32_flat_groups'][0]" not in _normalised(inspect.getsource(function)):
        return Probe(False, "extract_zero_shards_stage3 does not read fp32_flat_groups[0] alone")
    return Probe(True, "extract_zero_shards_stage3 reads fp32_flat_groups[0] and state[0] only, and cuts "
                       "every parameter of the model from that one sub-group's tensors")


def _read_loader() -> Probe:
    source = _normalised(inspect.getsource(_LOADER.code()))
    if "param_shapes[0].keys()" in source and "self.fp32_partitioned_groups_flat[0].data.copy_(" in source:
        return Probe(True, "load_hp_checkpoint_state_from_checkpoint_dir_stage3 fills fp32_partitioned_groups_flat[0] "
                           "from param_shapes[0] alone (the first sub-group)")
    return Probe(False, "load_hp_checkpoint_state_from_checkpoint_dir_stage3 does not fill the first sub-group alone")


def _normalised(source: str) -> str:
    return "".join(source.split()).replace('"', "'")


def _loops_over_param_shapes(function: Any) -> bool:
    """Whether ``function`` has a ``for`` loop over ``enumerate(param_shapes)`` or ``param_shapes``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    for node in ast.walk(tree):
        if isinstance(node, ast.For):
            loop = node.iter
            if isinstance(loop, ast.Call) and getattr(loop.func, "id", None) == "enumerate" and loop.args:
                loop = loop.args[0]
            if isinstance(loop, ast.Name) and loop.id == "param_shapes":
                return True
    return False


def _every_sub_group(original: Any, module: Any) -> Any:
    @functools.wraps(original)
    def extract_zero_shards_stage3(optim_files, param_shapes, dp_degree, temp_dir, dp_index):
        # upstream PR #7585: param_shapes is the model file's list, one {name: shape} per sub-group
        import torch

        state_dict = torch.load(optim_files[dp_index], map_location='cpu', weights_only=False)

        for idx, sub_group_shape in enumerate(param_shapes):
            flat_state = dict(
                exp_avg=state_dict[module.OPTIMIZER_STATE_DICT]['optimizer_state_dict']['state'][idx]["exp_avg"],
                exp_avg_sq=state_dict[module.OPTIMIZER_STATE_DICT]['optimizer_state_dict']['state'][idx]["exp_avg_sq"],
                fp32=state_dict[module.OPTIMIZER_STATE_DICT]['fp32_flat_groups'][idx],
            )
            offset = 0
            for name, shape in sub_group_shape.items():
                unpartitioned_numel = shape.numel()
                partitioned_numel, _ = module._zero_partitioned_param_info(unpartitioned_numel, dp_degree)
                padding_free_numel = min(partitioned_numel, abs(unpartitioned_numel - dp_index * partitioned_numel))
                for state_key in flat_state.keys():
                    module.dump_param_fragment(temp_dir, 0, dp_index, state_key, flat_state[state_key], name, offset,
                                               padding_free_numel)
                offset += partitioned_numel

    return extract_zero_shards_stage3


def _with_sub_group_shapes(original: Any, module: Any) -> Any:
    @functools.wraps(original)
    def _extract_zero_shard_files_stage3(args, optim_files, param_shapes, dp_degree, temp_dir):
        # main merged the model file's per-sub-group list into one dict; read the list again, as main does
        sub_group_shapes = module._parse_model_states_stage3(module._get_model_state_files(args.input_folder))
        merged = {name: shape for shapes in sub_group_shapes for name, shape in shapes.items()}
        if list(merged) != list(param_shapes):
            raise ValueError(f"{args.input_folder}: the model file's parameters {list(merged)} are not the "
                             f"ones main passed, {list(param_shapes)}")
        return original(args, optim_files, sub_group_shapes, dp_degree, temp_dir)

    return _extract_zero_shard_files_stage3


def _load_every_sub_group(original: Any) -> Any:
    import os

    # 0.16.0 - 0.16.3 purge the swapped optimizer state by hand, 0.16.4 on with optimizer_swapper.purge_state()
    purges_with_method = "purge_state()" in inspect.getsource(inspect.unwrap(original))

    @functools.wraps(original)
    def load_hp_checkpoint_state_from_checkpoint_dir_stage3(self, checkpoint_dir, param_shapes):
        """ Load optimizer and model states from the checkpoint directory. """
        # upstream PR #7585's loader, each sub-group with its own Adam step (PR #7585 shares state[0]['step'])
        import torch
        from deepspeed.checkpoint.constants import OPTIMIZER_STATE_DICT

        checkpoint_dir = os.path.join(checkpoint_dir, "zero")
        optim_state_path = os.path.join(checkpoint_dir, "optimizer_state.pt")
        assert os.path.isfile(
            optim_state_path), f'{optim_state_path} containing optimizer global state is missing! Cannot proceed.'

        optim_sd = torch.load(optim_state_path, weights_only=False)
        self._load_global_state_stage3(optim_sd)

        if len(param_shapes) != len(self.fp16_groups):
            raise ValueError(f"param_shapes names {len(param_shapes)} sub-groups, the ZeRO-3 optimizer has "
                             f"{len(self.fp16_groups)}")
        saved_state = optim_sd[OPTIMIZER_STATE_DICT]['state']
        for key in ["fp32", "exp_avg", "exp_avg_sq"]:
            for sub_group_id, sub_group_shapes in enumerate(param_shapes):
                fp32_param = self.fp32_partitioned_groups_flat[sub_group_id]
                key_tensor = torch.zeros_like(fp32_param)
                offset = 0
                for param_name in sub_group_shapes.keys():
                    key_layer_state_partition = self.load_hp_checkpoint_state(os.path.join(checkpoint_dir, param_name),
                                                                              key)
                    key_tensor.narrow(0, offset, key_layer_state_partition.numel()).copy_(key_layer_state_partition)
                    offset += key_layer_state_partition.numel()
                if key == "fp32":
                    self.fp32_partitioned_groups_flat[sub_group_id].data.copy_(key_tensor)
                    # this sub-group's own step (saved per sub-group; the first one's where the count differs)
                    step = saved_state.get(sub_group_id, saved_state[0])['step']
                    self.optimizer.state[fp32_param]['step'] = step.clone() if torch.is_tensor(step) else step
                else:
                    self.optimizer.state[fp32_param][key] = key_tensor

        saved_groups = optim_sd[OPTIMIZER_STATE_DICT]["param_groups"]
        for group_id, param_group in enumerate(self.optimizer.param_groups):
            saved_group = saved_groups[group_id if len(saved_groups) == len(self.optimizer.param_groups) else 0]
            for key, value in saved_group.items():
                if key == 'params':
                    param_group['params'] = []
                else:
                    param_group[key] = value

        if purges_with_method:
            if self.swap_optimizer:
                # Purge the swapped optimizer state, it was initialized to the freshly created model and not the checkpoint
                self.optimizer_swapper.purge_state()
        elif self.swap_optimizer or self.params_in_nvme_and_cpu:
            # Purge the swapped optimizer state, it was initialized to the freshly created model and not the checkpoint
            for swap_info in self.optimizer_swapper.swap_params_info.values():
                swap_info.tensors = [swap_info.tensors[0]]
                swap_info.has_state_tensors = False

        if self.swap_optimizer:
            # Touch all parameters to synchronize all buffers
            timer_names = set()
            self._partition_all_parameters()
            for sub_group_id, group in enumerate(self.fp16_groups):
                self._prepare_sub_group(sub_group_id, timer_names)
                self._reassign_or_swap_out_partitioned_parameters(sub_group_id)
                self._release_sub_group(sub_group_id, timer_names)
            self._post_step(timer_names)

        for sub_group_id in range(len(self.fp32_partitioned_groups_flat)):
            fp32_param = self.fp32_partitioned_groups_flat[sub_group_id]
            if sum(fp32_param.size()) > 0:
                fp16_param = self.fp16_partitioned_groups_flat[sub_group_id]
                fp16_param.data.copy_(fp32_param.data)

        for sub_group_id in range(len(self.fp16_partitioned_groups_flat)):
            updated_params = self.unflatten(self.fp16_partitioned_groups_flat[sub_group_id],
                                            self.fp16_partitioned_groups[sub_group_id])

            for partitioned_param, q in zip(self.fp16_partitioned_groups[sub_group_id], updated_params):
                partitioned_param.data = q.data

    return load_hp_checkpoint_state_from_checkpoint_dir_stage3


FIX = DsToUniversalZero3SubGroups()
