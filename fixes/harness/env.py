"""Single-process DeepSpeed set-up for notebooks and rank workers: CPU (gloo) or CUDA (nccl)."""
from __future__ import annotations

import gc
import logging
import os
import platform
import socket
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

_RANK_DEFAULTS = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}


@dataclass(frozen=True)
class Environment:
    """What a notebook ran on; printed in its Environment section and stored in its results."""

    python: str
    torch: str
    deepspeed: str
    deepspeed_path: str
    fixes_path: str  # the fixes package this kernel imported (a pip install, a checkout)
    accelerator: str
    device: str
    world_size: int
    rank: int

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def __str__(self) -> str:
        return "\n".join(f"{key:>15}: {value}" for key, value in asdict(self).items())


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (for MASTER_PORT)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def accelerator_name() -> str:
    """``cuda`` when a GPU is visible (Colab), else ``cpu``."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


# Where the ranks this process launched ran ("cpu", "cuda"; fixes.harness.launch adds to it): a notebook's run record
# says so, since with fewer GPUs than ranks a notebook on a GPU runs its ranks on CPU.
RANK_DEVICES: set[str] = set()


def rank_placement(world_size: int) -> tuple[str, str]:
    """Where ``world_size`` launched ranks run: (``cuda`` or ``cpu``, why, if not where this process
    runs). One GPU per rank; with fewer GPUs than ranks (a one-GPU Colab and a two-rank check) every
    rank runs on CPU with gloo instead, and the reason says so."""
    import torch

    here = accelerator_name()
    if here == "cuda" and world_size > torch.cuda.device_count():
        return "cpu", (f"{world_size} ranks but {torch.cuda.device_count()} GPU(s) here: the {world_size} ranks run "
                       "on CPU (gloo), as the Fixbook's CI runs them")
    return here, ""


def use_cpu_only() -> None:
    """Make this process see no GPU, before anything touches CUDA (a rank placed on CPU)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["DS_ACCELERATOR"] = "cpu"


def setup(seed: int = 0) -> Environment:
    """Initialise DeepSpeed's process group for this process and return what it runs on.

    Idempotent. Rank variables default to a single process (RANK=0, WORLD_SIZE=1) with a free
    MASTER_PORT; ranks started by :func:`fixes.harness.launch` set their own before calling this.
    On the CPU accelerator the shared-memory comm op is not built (see ``_skip_shm_comm_build``).
    """
    import torch

    # torch.distributed's own deprecation notices for calls inside DeepSpeed: noise in every cell.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    accelerator = accelerator_name()
    os.environ.setdefault("DS_ACCELERATOR", accelerator)  # read when DeepSpeed first picks its accelerator
    for key, value in _RANK_DEFAULTS.items():
        os.environ.setdefault(key, value)
    own_port = "MASTER_PORT" not in os.environ
    os.environ.setdefault("MASTER_PORT", str(free_port()))

    import deepspeed

    if accelerator == "cpu":
        _skip_shm_comm_build()
    keep_cpu_info()
    if not torch.distributed.is_initialized():
        _init_distributed(deepspeed, "gloo" if accelerator == "cpu" else "nccl", retry_port=own_port)
    if accelerator == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(seed)
    # DeepSpeed calls gc.collect() in see_memory_usage(force=True), 11 times while building a ZeRO-3
    # engine; with torch and DeepSpeed loaded each full collection took ~0.4 s on 2 cores. Freezing
    # what exists now (imported modules) limits collections to objects made later: a ZeRO-3 engine
    # then builds in ~0.05 s instead of ~4.5 s. Only speed changes; results are the same.
    gc.freeze()
    return describe()


PORT_ATTEMPTS = 3


def port_taken(error: BaseException | str) -> bool:
    """Whether ``error`` is a bind that found its port taken (``EADDRINUSE``)."""
    return "EADDRINUSE" in str(error)


def _init_distributed(deepspeed: object, backend: str, retry_port: bool) -> None:
    """``deepspeed.init_distributed``. Where this process picked ``MASTER_PORT`` itself (``retry_port``), a port
    that another process took between :func:`free_port` and the bind (notebooks run side by side) is replaced by
    a new one and the call tried again, :data:`PORT_ATTEMPTS` times in all; any other error is raised at once."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            deepspeed.init_distributed(dist_backend=backend, verbose=False)  # type: ignore[attr-defined]
            return
        except RuntimeError as exc:  # torch's DistNetworkError is a RuntimeError
            if not retry_port or not port_taken(exc) or attempt == PORT_ATTEMPTS:
                raise
            os.environ["MASTER_PORT"] = str(free_port())


def describe() -> Environment:
    import deepspeed
    import torch

    accelerator = accelerator_name()
    device = torch.cuda.get_device_name() if accelerator == "cuda" else (platform.processor() or "cpu")
    return Environment(
        python=sys.version.split()[0],
        torch=torch.__version__,
        deepspeed=deepspeed.__version__,
        deepspeed_path=os.path.dirname(deepspeed.__file__),
        fixes_path=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        accelerator=accelerator,
        device=device,
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        rank=int(os.environ.get("RANK", "0")),
    )


def device() -> "torch.device":  # noqa: F821 - torch is imported lazily
    import torch

    if accelerator_name() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def cpu_info_file() -> Path | None:
    """Where :func:`keep_cpu_info` keeps this machine's py-cpuinfo answer: one file per CPU (a digest of
    ``/proc/cpuinfo`` without its clock lines) and py-cpuinfo version, in the user's cache directory. None where
    there is no ``/proc/cpuinfo`` or no py-cpuinfo."""
    import hashlib
    import importlib.metadata

    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        version = importlib.metadata.version("py-cpuinfo")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    digest = hashlib.sha256("\n".join([version, *(line for line in lines if "MHz" not in line)]).encode()).hexdigest()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "fixbook" / f"cpuinfo-{digest[:16]}.json"


def keep_cpu_info() -> None:
    """Answer py-cpuinfo's ``get_cpu_info()`` from :func:`cpu_info_file`, computed by the first process that asks.

    DeepSpeed's CPU op builders ask it twice each time a process loads an op (``OpBuilder.cpu_arch`` and
    ``simd_width``, for the compiler's flags), ``DeepSpeedCPUAdam`` once more, and py-cpuinfo answers each call
    by running a new Python: 2.3 of the 2.4 s a one-rank ZeRO-3 engine with DeepSpeed's FusedAdam took to build
    on 2 cores, its op already compiled (cProfile). The answer depends only on the CPU. Harness set-up, not a
    fix: DeepSpeed gets the dict py-cpuinfo gives (its clock fields as they were when it was kept). Idempotent;
    nothing is changed where :func:`cpu_info_file` is None."""
    import json

    from ..files import write_atomic

    try:
        import cpuinfo
    except ImportError:
        return
    original = getattr(cpuinfo.get_cpu_info, "__wrapped__", cpuinfo.get_cpu_info)
    path = cpu_info_file()
    if path is None:
        return

    def get_cpu_info() -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass
        info = original()
        try:
            write_atomic(path, json.dumps(info))  # whole or not at all: another process may read it now
        except OSError:
            pass
        return info

    get_cpu_info.__wrapped__ = original  # type: ignore[attr-defined]
    cpuinfo.get_cpu_info = get_cpu_info


def _skip_shm_comm_build() -> None:
    """Stop DeepSpeed from JIT-compiling ``deepspeed_shm_comm`` in ``init_distributed``.

    On the CPU accelerator ``TorchBackend.__init__`` (deepspeed/comm/torch.py) calls
    ``build_shm_op()``, a C++ build of 1.5-3 minutes on 2 cores. The op only speeds up intra-node
    all-reduce; with it skipped DeepSpeed uses plain gloo collectives and results were identical on
    1 and 2 ranks. This is harness set-up, not a fix: a user's CUDA job never reaches it.
    Note ``import deepspeed.comm.torch`` would give the *torch* package (deepspeed.comm re-exports
    it), so the submodule is taken from ``sys.modules``.
    """
    import importlib

    comm_torch = importlib.import_module("deepspeed.comm.torch")
    if hasattr(comm_torch, "build_shm_op"):
        comm_torch.build_shm_op = lambda: None


class _Once(logging.Filter):
    """Passes the first record of each distinct message, marked as folded; drops its repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, str]] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        record.msg, record.args = f"{key[1]} (shown once: its repeats in this run are folded)", None
        return True


def fold_repeated_warnings() -> None:
    """Show each distinct DeepSpeed log line once in this process: a notebook that builds an engine per
    configuration would otherwise print the same warning for each ("You are using ZeRO with an untested optimizer",
    logged once per engine). Idempotent; the lines themselves are DeepSpeed's, unchanged but for the mark."""
    from deepspeed.utils import logger

    if not any(isinstance(existing, _Once) for existing in logger.filters):
        logger.addFilter(_Once())
