"""The pipeline engine's nested backward is refused (upstream PR #7787).

Where ``DeepSpeedEngine.forward`` registers backward hooks on every output
(``register_output_backward_hooks``, PR #7665), the hooks run DeepSpeed's backward prologue.
``DeepSpeedEngine._backward_prologue`` refuses a backward that ``engine.backward`` did not start
(the ``_running_engine_backward`` flag) when the engine has no ZeRO optimizer
(``_support_torch_style_backward`` is False: ZeRO stage 0 in fp32, the usual pipeline set-up, and
bf16 where it gets FP16_UnfusedOptimizer). ``PipelineEngine._exec_backward_pass`` runs every stage
but the last with ``torch.autograd.backward(outputs, received_grads)``, not ``engine.backward``: the
first stage raises in its first backward, and the next stays blocked sending it gradients.
The same hooks also divide every stage's output gradient by ``gradient_accumulation_steps`` (the entry
pipeline-stages-divide-by-gas-twice, which this fix ``requires``: ``apply()`` applies it first where its bug
is installed, so on the releases that have the refusal this fix makes the pipeline train like plain PyTorch).

The fix, where the probe finds the refusal and no ``_running_engine_backward`` in
``_exec_backward_pass``:

* ``_exec_backward_pass`` is replaced by the same method with the nested backward marked as the
  engine's own (PR #7787), in the class and in its ``_INSTRUCTION_MAP`` (``train_batch`` dispatches
  through that map, which holds the function object from the class body; ``patches()`` checks it
  does and raises DriftError otherwise).
"""
from __future__ import annotations

import inspect
from typing import Any

from ...exceptions import DriftError
from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module, undecorated

_PIPE = "deepspeed.runtime.pipe.engine"
_ENGINE = "deepspeed.runtime.engine"
_REFUSAL = "Direct calls to tensor.backward() are not supported"


class PipelineNestedBackward(Fix):
    requires = ("pipeline-stages-divide-by-gas-twice",)
    targets = (
        Target(_PIPE, "PipelineEngine._exec_backward_pass"),
        Target(_ENGINE, "DeepSpeedEngine._backward_prologue"),
    )

    def read_code(self) -> Probe:
        engine = import_target_module(_ENGINE).DeepSpeedEngine
        pipe = import_target_module(_PIPE).PipelineEngine
        if "register_output_backward_hooks" not in inspect.getsource(undecorated(engine.forward)):
            return Probe(False, "DeepSpeedEngine.forward registers no output backward hooks (before PR #7665)")
        if _REFUSAL not in inspect.getsource(engine._backward_prologue):
            return Probe(False, "DeepSpeedEngine._backward_prologue does not refuse direct backward calls")
        if "_running_engine_backward" in inspect.getsource(pipe._exec_backward_pass):
            return Probe(False, "PipelineEngine._exec_backward_pass marks its nested backward (PR #7787)")
        return Probe(True, "forward hooks refuse direct backward calls and PipelineEngine._exec_backward_pass "
                           "runs torch.autograd.backward without marking it as the engine's own")

    def patches(self) -> list[AttributePatch]:
        module = import_target_module(_PIPE)
        pipe = module.PipelineEngine
        # train_batch does not call self._exec_backward_pass: _exec_schedule looks the method up in the
        # class-level _INSTRUCTION_MAP, which holds the function object from the class body. So the map
        # is replaced too (by a copy with the fixed method; revert puts the original dict back).
        backward = module.schedule.BackwardPass
        if pipe._INSTRUCTION_MAP.get(backward) is not vars(pipe)["_exec_backward_pass"]:
            raise DriftError(f"{_PIPE}.PipelineEngine._INSTRUCTION_MAP[BackwardPass] is not "
                             "PipelineEngine._exec_backward_pass: the instruction dispatch is not the code this fix "
                             "was written for. Nothing was patched.")
        fixed = _exec_backward_pass()
        return [AttributePatch(pipe, "_exec_backward_pass", fixed),
                AttributePatch(pipe, "_INSTRUCTION_MAP", {**pipe._INSTRUCTION_MAP, backward: fixed})]


def _exec_backward_pass() -> Any:
    pipe = import_target_module(_PIPE)  # the module's own names, as the original uses them
    torch, PartitionedTensor = pipe.torch, pipe.PartitionedTensor
    BACKWARD_MICRO_TIMER, BACKWARD_GLOBAL_TIMER = pipe.BACKWARD_MICRO_TIMER, pipe.BACKWARD_GLOBAL_TIMER
    BACKWARD_INNER_MICRO_TIMER, BACKWARD_INNER_GLOBAL_TIMER = (pipe.BACKWARD_INNER_MICRO_TIMER,
                                                               pipe.BACKWARD_INNER_GLOBAL_TIMER)
    DeepSpeedEngine = pipe.DeepSpeedEngine

    def _exec_backward_pass(self, buffer_id):
        # DeepSpeed 0.18.3/0.18.4's method, line for line, except the marked block.
        assert self.optimizer is not None, "must provide optimizer during " \
                                           "init in order to use backward"

        # The last stage just runs backward on the loss using DeepSpeed's typical
        # mechanisms.
        if self.is_last_stage():
            DeepSpeedEngine.backward(self, self.loss)  # the original's super().backward(self.loss)
            return

        outputs = self.pipe_buffers['outputs'][buffer_id]

        if self.wall_clock_breakdown():
            self.timers(BACKWARD_MICRO_TIMER).start()
            self.timers(BACKWARD_GLOBAL_TIMER).start()
            self.timers(BACKWARD_INNER_MICRO_TIMER).start()
            self.timers(BACKWARD_INNER_GLOBAL_TIMER).start()

        # Reconstruct if we previously partitioned the output. We must be
        # careful to also restore the computational graph of the tensors we partitioned.
        if self.is_pipe_partitioned:
            if self.is_grad_partitioned:
                if self.pipe_partition_output_meta_cache is None:
                    self.pipe_partition_output_meta_cache = outputs[0].to('cpu')
                part_output = PartitionedTensor.from_meta(meta=self.pipe_partition_output_meta_cache,
                                                          local_part=outputs[1],
                                                          group=self.grid.get_slice_parallel_group())
                self.pipe_buffers['output_tensors'][buffer_id].data = part_output.full()
                outputs = (self.pipe_buffers['output_tensors'][buffer_id], *outputs[2:])
            else:
                # Already restored from partition
                self.pipe_buffers['output_tensors'][buffer_id].data = outputs[0]
                outputs = (self.pipe_buffers['output_tensors'][buffer_id], *outputs[1:])

        grad_tensors = self.grad_layer
        if self.is_grad_partitioned:
            if self.grad_partition_grad_layer_meta_cache is None:
                self.grad_partition_grad_layer_meta_cache = self.grad_layer[0].to('cpu')
            part_grad = PartitionedTensor.from_meta(meta=self.grad_partition_grad_layer_meta_cache,
                                                    local_part=self.grad_layer[1],
                                                    group=self.grid.get_slice_parallel_group())
            grad_tensors = (part_grad.full(), *grad_tensors[2:])
            part_grad = None

        if self.using_bf16_optimizer and not self.is_last_stage():
            # manually call because we don't call optimizer.backward()
            self.optimizer.clear_lp_grads()

        # The fix (PR #7787): this backward is the engine's own, so the output hooks registered by
        # DeepSpeedEngine.forward must not refuse it (nor run the post-backward epilogue).
        self._running_engine_backward = True
        try:
            # This handles either a single tensor or tuple of tensors.
            if isinstance(outputs, tuple):
                out_tensors = [t for t in outputs if t.is_floating_point()]
                assert len(out_tensors) == len(grad_tensors)
                torch.autograd.backward(tensors=out_tensors, grad_tensors=grad_tensors)
            else:
                torch.autograd.backward(tensors=(outputs, ), grad_tensors=(grad_tensors, ))
        finally:
            self._running_engine_backward = False

        if self.using_bf16_optimizer and not self.is_last_stage():
            # manually call because we don't call optimizer.backward()
            if not self._config.bfloat16_config.immediate_grad_update:
                self.optimizer.update_hp_grads(clear_lp_grads=False)

        # Free up the memory from the output of forward()
        self.pipe_buffers['output_tensors'][buffer_id] = None
        self.pipe_buffers['outputs'][buffer_id] = None
        grad_tensors = None

        if self.wall_clock_breakdown():
            self.timers(BACKWARD_INNER_MICRO_TIMER).stop()
            self.timers(BACKWARD_INNER_GLOBAL_TIMER).stop()
            self.timers(BACKWARD_MICRO_TIMER).stop()
            self.timers(BACKWARD_GLOBAL_TIMER).stop()

    return _exec_backward_pass


FIX = PipelineNestedBackward()
