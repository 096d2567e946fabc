"""How launcher-venv-script-drops-export is reproduced: the fast check the release sweep runs (``reproduce()``: True
where the bug shows), with no fix applied. Imported by the sweep, the tests and the notebook, never by the fix or its
probe. The launch itself is in ``pdsh.py`` beside it."""
from __future__ import annotations

from typing import Any

from ...exceptions import CannotTellError


def shows(run: Any) -> bool:
    """Whether a configured variable does not reach a node. Raises CannotTellError where the activation script did
    not run on a node (then the launch failed some other way, and says nothing about the dropped export)."""
    if run.pdsh and "VIRTUAL_ENV" in run.expected:
        unsourced = [node for node, seen in zip(run.nodes, run.seen) if seen.get("VIRTUAL_ENV") is None]
        if unsourced:
            raise CannotTellError(f"the --venv_script did not run on {', '.join(unsourced)}")
    return run.any_lost


def reproduce() -> bool:
    """``deepspeed --hostfile hostfile --venv_script <venv>/bin/activate train.py`` over two nodes (the pdsh
    launcher): True if a node's launcher starts without one of the variables the user configured (the launching
    shell's forwarded ``MLFLOW_TRACKING_URI``, DeepSpeed's ``PYTHONPATH``, ``.deepspeed_env``'s lines, the
    activation script's ``VIRTUAL_ENV``). False on a launcher without ``--venv_script`` (before 0.17.1): there is
    no such launch to get wrong."""
    from .pdsh import has_venv_script, launch

    if not has_venv_script():
        return False
    return shows(launch())


# ---- the trigger's grid --------------------------------------------------------------------------------------------

def trigger_cells() -> list:
    """The trigger's grid (``python -m ci.sweep.triggers``): the launch of :func:`reproduce` over two nodes of one slot
    each, and the same command with a hostfile of one node (world size 1), where the launcher starts the per-node
    launcher itself, with its own environment, and pdsh is not used. A DeepSpeed config cannot show how a job is
    launched (pdsh, ``--venv_script``): the trigger's note says so, and no cell flips them, since the trigger has no
    condition that reads them."""
    from ...harness import Cell, trigger_job
    from .pdsh import ONE_NODE, TWO_NODES, launch

    return [Cell("two nodes, pdsh, --venv_script", trigger_job(None, 2), lambda: shows(launch(TWO_NODES))),
            Cell("one node: the launcher starts the ranks itself, no pdsh", trigger_job(None, 1),
                 lambda: shows(launch(ONE_NODE)), "world_size")]
