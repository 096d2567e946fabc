"""How launcher-mpi-exports-quoted is reproduced: the fast check the release sweep runs (``reproduce()``: True where
the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its probe.
The launch itself is in ``mpirun.py`` beside it."""
from __future__ import annotations

from typing import Any, ContextManager

from ...exceptions import CannotTellError

# Where its bug is installed, the OpenMPI launcher stops before it collects any export: measured with its fix.
MASKING_FIX = "launcher-openmpi-premature-env-check"


def shows(run: Any) -> bool:
    """Whether a configured variable reaches the ranks with another value. Raises CannotTellError where one does not
    reach them at all (the launch went wrong some other way, which says nothing about the quotes)."""
    missing = [key for key in run.expected if run.seen.get(key) is None]
    if missing:
        raise CannotTellError(f"{', '.join(missing)} do not reach the ranks at all")
    return bool(run.wrong)


def launched(nodes: Any = None, launcher: str = "openmpi") -> Any:
    """:func:`mpirun.launch`, with the OpenMPI launcher's premature check (another entry's bug) as CannotTellError."""
    from .mpirun import TWO_NODES, launch

    try:
        return launch(TWO_NODES if nodes is None else nodes, launcher)
    except OSError as exc:
        raise CannotTellError(f"the launcher stopped before its command ({MASKING_FIX}): {exc}") from exc


def reproduce() -> bool:
    """``deepspeed --hostfile hostfile --launcher openmpi train.py`` over two nodes: True if a variable the user
    configured (the launching shell's forwarded ``MLFLOW_TRACKING_URI``, DeepSpeed's ``PYTHONPATH``, the lines of
    ``.deepspeed_env``) reaches the ranks with another value than configured (in double quotes)."""
    return shows(launched())


def measurement_context() -> ContextManager[bool]:
    """Where launcher-openmpi-premature-env-check's bug is installed (its probe says so), its fix is applied for the
    measurement, so that the OpenMPI launcher gets as far as its command; a no-op elsewhere."""
    from ...harness.entry import fixed_where_installed

    return fixed_where_installed(MASKING_FIX)


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the launch of :func:`reproduce` over two nodes with each
    MPI launcher (OpenMPI, MPICH, Intel MPI, MVAPICH: every condition holds); the OpenMPI command with a hostfile of
    one node (world size 1), where the launcher starts the per-node launcher itself with its own environment; and the
    two nodes with the pdsh launcher (no ``--venv_script``, so launcher-venv-script-drops-export's bug is not
    walked into), whose exports a shell reads."""
    from ...harness import Cell, trigger_job
    from .mpirun import MPI_LAUNCHERS, ONE_NODE, TWO_NODES

    use = "mpi-launch"
    return [*(Cell(f"two nodes, --launcher {launcher}", trigger_job(None, 2, [use]),
                   lambda launcher=launcher: shows(launched(TWO_NODES, launcher))) for launcher in MPI_LAUNCHERS),
            Cell("one node, --launcher openmpi: the launcher starts the ranks itself", trigger_job(None, 1, [use]),
                 lambda: shows(launched(ONE_NODE)), "world_size"),
            Cell("two nodes, --launcher pdsh: a shell reads the exports", trigger_job(None, 2),
                 lambda: shows(launched(TWO_NODES, "pdsh")), f"uses:{use}")]
