"""How launcher-openmpi-premature-env-check is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe. The launch itself is in ``mpirun.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError

MESSAGE = "MPI environment variables are not set. Ensure you are running the script with an MPI-compatible launcher."


def shows(run: Any) -> bool:
    """True where the launcher stopped with the premature check's error; False where it built its command. Raises
    CannotTellError where it stopped with another error (which says nothing about this bug)."""
    if run.error is None:
        return False
    if run.error == f"OSError: {MESSAGE}":
        return True
    raise CannotTellError(f"the launcher stopped with another error: {run.error}")


def reproduce() -> bool:
    """``deepspeed --hostfile hostfile --launcher openmpi train.py`` over two nodes of one slot each, from a shell
    with no ``OMPI_COMM_WORLD_*`` variable: True if the launcher raises the check's error instead of starting
    mpirun."""
    from .mpirun import launch

    return shows(launch())


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the launch of :func:`reproduce` (two nodes, OpenMPI); the
    same command with a hostfile of one node (world size 1), where the launcher starts the per-node launcher itself
    and builds no OpenMPI runner; and the same two nodes with the pdsh launcher (no ``--venv_script``, so
    launcher-venv-script-drops-export's bug is not walked into)."""
    from ...harness import Cell, trigger_job
    from .mpirun import ONE_NODE, TWO_NODES, launch

    use = "openmpi-launch"
    return [Cell("two nodes, --launcher openmpi", trigger_job(None, 2, [use]), lambda: shows(launch(TWO_NODES))),
            Cell("one node, --launcher openmpi: the launcher starts the ranks itself", trigger_job(None, 1, [use]),
                 lambda: shows(launch(ONE_NODE)), "world_size"),
            Cell("two nodes, --launcher pdsh", trigger_job(None, 2), lambda: shows(launch(TWO_NODES, "pdsh")),
                 f"uses:{use}")]
