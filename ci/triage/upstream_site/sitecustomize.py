"""Loaded at the start of every Python that ``python -m ci.triage`` runs an upstream test in (pytest, its
forkserver, the ranks): this directory is first on their ``PYTHONPATH``. Nothing here edits a test.

* ``FIXBOOK_TRIAGE_EDITS=1``: the CPU edits. A call that only a GPU answers (``tensor.cuda()``, a tensor made
  on ``"cuda:0"``, ``torch.cuda.synchronize()``) goes to the CPU instead, and only when the *test file* makes
  it: DeepSpeed's own calls are left as they are. Each edit that fires is written once per process to
  ``FIXBOOK_TRIAGE_LOG``, so a run records exactly the edits it needed.
* ``FIXBOOK_TRIAGE_APPLY=ID[,ID]``: ``fixes.apply(...)`` before the test runs, in every process, as a user's
  job would call it; the outcome goes to the log. A process that joins a process group (each rank upstream's
  ``DistributedTest`` starts, forked or spawned) applies any of them it does not hold yet, then writes which fixes
  it holds to ``FIXBOOK_TRIAGE_PROCESSES``: one JSON line per process (pid, rank, world size, applied, missing),
  the proof that every rank ran with the fix. The pytest process writes its line (rank ``pytest``) as its session
  starts (``fixbook_triage_report``).
* ``FIXBOOK_TRIAGE_STACKS=DIR``: every process writes the stacks of its threads to ``DIR/<pid>.txt`` every
  ``FIXBOOK_TRIAGE_STACK_S`` seconds while it lives (a forked process starts its own), and faulthandler writes to
  ``DIR/<pid>.txt.fatal`` on a fatal signal, so a run that hangs records where each process was waiting.

Never raises: a failure here is logged and the test runs without it.
"""
import os
import sys

_TESTS = os.environ.get("FIXBOOK_TRIAGE_TESTS", "")
_LOG = os.environ.get("FIXBOOK_TRIAGE_LOG", "")
_fired = set()


def _log(line):
    if _LOG:
        with open(_LOG, "a") as handle:
            handle.write(line + "\n")


def _note(edit):
    if edit not in _fired:
        _fired.add(edit)
        _log("edit: " + edit)


def _from_test():
    """Whether the caller of the edited function (two frames up: the wrapper, then its caller) is a test file."""
    return bool(_TESTS) and sys._getframe(2).f_code.co_filename.startswith(_TESTS)


def _test_frames():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_TESTS):
            yield frame
        frame = frame.f_back


def _called_from_test():
    """Whether a test file is anywhere up the stack (the call went through DeepSpeed's wrappers)."""
    return bool(_TESTS) and next(_test_frames(), None) is not None


def _test_function():
    """The innermost test-file function up the stack: the one whose call an edit changed."""
    found = next(_test_frames(), None)
    return found.f_code.co_name if found is not None else "?"


def _cuda_device(value):
    import torch

    if isinstance(value, str):
        return value.startswith("cuda") or value.isdigit()  # "0": a device index written as a string
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)


def _install_edits():
    import functools

    import torch

    def tensor_cuda(original):
        @functools.wraps(original)
        def cuda(self, *args, **kwargs):
            if _from_test():
                _note("tensor.cuda() -> CPU")
                return self.to("cpu") if isinstance(self, torch.Tensor) else self
            return original(self, *args, **kwargs)
        return cuda

    def to(original, edit):
        @functools.wraps(original)
        def moved(self, *args, **kwargs):
            if _from_test():
                if args and _cuda_device(args[0]):
                    _note(edit)
                    args = ("cpu", *args[1:])
                if _cuda_device(kwargs.get("device")):
                    _note(edit)
                    kwargs["device"] = "cpu"
            return original(self, *args, **kwargs)
        return moved

    def factory(original):
        @functools.wraps(original)
        def made(*args, **kwargs):
            if _cuda_device(kwargs.get("device")) and _from_test():
                _note(f"device='cuda' -> CPU (torch.{original.__name__} in {_test_function()})")
                kwargs["device"] = "cpu"
            return original(*args, **kwargs)
        return made

    def no_op(name):
        def nothing(*args, **kwargs):
            _note(f"torch.cuda.{name}() -> no-op")
        return nothing

    def ddp_init(original):
        @functools.wraps(original)
        def init(self, module, *args, **kwargs):
            on_cpu = all(p.device.type == "cpu" for p in module.parameters())
            if on_cpu and _from_test() and (kwargs.get("device_ids") is not None or args):
                _note(f"DistributedDataParallel(device_ids=..., output_device=...) -> without them, the module being "
                      f"on CPU (in {_test_function()})")
                kwargs.pop("device_ids", None)
                kwargs.pop("output_device", None)
                args = args[2:]  # device_ids, output_device given by position
            return original(self, module, *args, **kwargs)
        return init

    def gather_into_tensor(original):
        @functools.wraps(original)
        def gathered(output_tensor, input_tensor, *args, **kwargs):
            if (input_tensor.dim() == 0 and output_tensor.dim() == 1 and _called_from_test()
                    and output_tensor.device.type == "cpu"):
                _note("all_gather_into_tensor of a 0-dim tensor -> the same value as 1-dim (gloo checks each rank's "
                      f"chunk shape; NCCL does not) (in {_test_function()})")
                input_tensor = input_tensor.reshape(1)
            return original(output_tensor, input_tensor, *args, **kwargs)
        return gathered

    torch.distributed.all_gather_into_tensor = gather_into_tensor(torch.distributed.all_gather_into_tensor)
    torch.nn.parallel.DistributedDataParallel.__init__ = ddp_init(torch.nn.parallel.DistributedDataParallel.__init__)
    torch.Tensor.cuda = tensor_cuda(torch.Tensor.cuda)
    torch.nn.Module.cuda = tensor_cuda(torch.nn.Module.cuda)
    torch.Tensor.to = to(torch.Tensor.to, "tensor.to('cuda') -> CPU")
    torch.nn.Module.to = to(torch.nn.Module.to, "module.to('cuda') -> CPU")
    for name in ("tensor", "as_tensor", "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm",
                 "arange", "linspace", "eye", "zeros_like", "ones_like", "empty_like", "full_like", "rand_like",
                 "randn_like"):
        setattr(torch, name, factory(getattr(torch, name)))
    if not torch.cuda.is_available():
        original_current = torch.cuda.current_device

        def current_device():
            if _from_test():
                _note("torch.cuda.current_device() -> 0")
                return 0
            return original_current()
        torch.cuda.current_device = current_device
        torch.cuda.synchronize = no_op("synchronize")
        torch.cuda.set_device = no_op("set_device")


def _edit_when_torch_is_imported():
    """Install the edits right after ``import torch`` completes, wherever it happens (a process that never imports
    torch pays nothing)."""
    import importlib.abc
    import importlib.util

    class AfterTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "torch":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            if spec is None or spec.loader is None:
                return spec
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                try:
                    _install_edits()
                except Exception as exc:  # noqa: BLE001 - the test then runs unedited, and the log says why
                    _log(f"edits not installed: {type(exc).__name__}: {exc}")
            spec.loader.exec_module = exec_module
            return spec

    if "torch" in sys.modules:
        _install_edits()
    else:
        sys.meta_path.insert(0, AfterTorch())


def _dump_stacks():
    """Write this process's stacks to its own file of ``FIXBOOK_TRIAGE_STACKS`` every ``FIXBOOK_TRIAGE_STACK_S``
    seconds (a daemon thread, started again in each forked process: faulthandler's own timer thread does not
    survive a fork), in faulthandler's format; faulthandler itself writes there on a fatal signal."""
    import faulthandler
    import threading
    import time
    import traceback

    folder, every = os.environ["FIXBOOK_TRIAGE_STACKS"], float(os.environ.get("FIXBOOK_TRIAGE_STACK_S") or 60)
    path = os.path.join(folder, f"{os.getpid()}.txt")
    handle = open(path + ".fatal", "w")  # kept open: faulthandler writes to its fd
    _stacks[:] = [handle]
    faulthandler.enable(file=handle, all_threads=True)
    me = threading.get_ident

    def write():
        while True:
            time.sleep(every)
            lines = [f"Timeout ({every:.0f} s)!"]
            for ident, frame in sys._current_frames().items():
                if ident == me():
                    continue
                lines.append(f"Thread 0x{ident:016x} (most recent call first):")
                for summary in reversed(traceback.extract_stack(frame)):
                    lines.append(f'  File "{summary.filename}", line {summary.lineno} in {summary.name}')
            with open(path, "w") as out:
                out.write("\n".join(lines) + "\n")

    threading.Thread(target=write, name="fixbook-stacks", daemon=True).start()


_stacks = []
if os.environ.get("FIXBOOK_TRIAGE_STACKS"):
    try:
        _dump_stacks()
        os.register_at_fork(after_in_child=_dump_stacks)
    except Exception as exc:  # noqa: BLE001
        _log(f"stacks not dumped: {type(exc).__name__}: {exc}")

if os.environ.get("FIXBOOK_TRIAGE_EDITS") == "1":
    try:
        _edit_when_torch_is_imported()
    except Exception as exc:  # noqa: BLE001 - the test then runs unedited, and the log says why
        _log(f"edits not installed: {type(exc).__name__}: {exc}")

_APPLY = [i for i in os.environ.get("FIXBOOK_TRIAGE_APPLY", "").split(",") if i]


def _apply():
    """``fixes.apply`` of each wanted fix this process does not hold yet; the outcome goes to the log."""
    try:
        import fixes

        for outcome in fixes.apply(*_APPLY):
            _log(f"fix: {outcome.fix_id}: {outcome.action}")  # once per process; the reader keeps each line once
    except Exception as exc:  # noqa: BLE001
        _log(f"fix: not applied: {type(exc).__name__}: {exc}")


def _held():
    """The wanted fixes applied in this process (inherited through a fork or applied here)."""
    if "fixes" not in sys.modules:
        return []
    try:
        from fixes.registry import get

        return [i for i in _APPLY if get(i).applied]
    except Exception:  # noqa: BLE001 - then none is proven held
        return []


def _record_process(rank=None, world_size=None):
    import json

    path = os.environ.get("FIXBOOK_TRIAGE_PROCESSES")
    if not path:
        return
    held = _held()
    line = {"pid": os.getpid(), "rank": rank, "world_size": world_size, "applied": held,
            "missing": [i for i in _APPLY if i not in held]}
    with open(path, "a") as handle:
        handle.write(json.dumps(line) + "\n")


def _prove_in_each_rank():
    """Wrap ``torch.distributed.init_process_group``: a process joining a group applies what it lacks, then records
    which fixes it holds, with its rank."""
    import functools

    import torch.distributed

    original = torch.distributed.init_process_group

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if [i for i in _APPLY if i not in _held()]:
            _apply()
        done = original(*args, **kwargs)
        try:
            _record_process(torch.distributed.get_rank(), torch.distributed.get_world_size())
        except Exception as exc:  # noqa: BLE001
            _log(f"fix: rank not recorded: {type(exc).__name__}: {exc}")
        return done

    torch.distributed.init_process_group = init_process_group


if _APPLY:
    _apply()
    try:
        _prove_in_each_rank()
    except Exception as exc:  # noqa: BLE001
        _log(f"fix: ranks not watched: {type(exc).__name__}: {exc}")
