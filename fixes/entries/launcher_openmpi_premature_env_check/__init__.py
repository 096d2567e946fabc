"""Fix for launcher-openmpi-premature-env-check: the backport of upstream PR #7751, one wrapper.

``OpenMPIRunner.validate_args`` (``deepspeed/launcher/multinode_runner.py``), which ``MultiNodeRunner.__init__``
calls when the ``deepspeed`` command builds its OpenMPI runner, first calls ``self._setup_mpi_environment()``: the
check that raises where the ``OMPI_COMM_WORLD_*`` variables are not set. Upstream's fix deletes that call (and the
method); the rest of ``validate_args`` (no include/exclude, no num_nodes/num_gpus) stays. The wrapper calls the
original with ``_setup_mpi_environment`` shadowed on the instance by a function that does nothing, then removes the
shadow: every other check runs as installed. What the deleted call did where the variables were set (copy them to
``LOCAL_RANK``/``RANK``/``WORLD_SIZE`` of the launcher's own ``os.environ``, after ``main`` had already copied the
environment it hands to ``mpirun``) changed nothing of the launch, and is not done either, as upstream's fix.

Apply it in the process that runs the launcher (the ``deepspeed`` command), before it builds its runner:
``python -c "import fixes, sys; fixes.apply('launcher-openmpi-premature-env-check'); from deepspeed.launcher.runner
import main; sys.exit(main())" --hostfile ... --launcher openmpi train.py``. The probe reads whether the installed
``validate_args`` calls ``_setup_mpi_environment``.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.launcher.multinode_runner"
_VALIDATE = Target(_MODULE, "OpenMPIRunner.validate_args")
_CALL = re.compile(r"^\s*self\._setup_mpi_environment\(\)", re.MULTILINE)


def _nothing() -> None:
    """What ``_setup_mpi_environment`` does while the fixed ``validate_args`` runs."""


class LauncherOpenmpiPrematureEnvCheck(Fix):
    targets = (_VALIDATE,)

    def read_code(self) -> Probe:
        runner = getattr(import_target_module(_MODULE), "OpenMPIRunner")
        source = inspect.getsource(vars(runner)["validate_args"])
        if _CALL.search(source):
            return Probe(True, "OpenMPIRunner.validate_args calls self._setup_mpi_environment(), which raises "
                               "without OMPI_COMM_WORLD_* variables")
        return Probe(False, "OpenMPIRunner.validate_args does not call _setup_mpi_environment")

    def patches(self) -> list[AttributePatch]:
        return [_VALIDATE.wrap(_without_env_check)]


def _without_env_check(original: Any) -> Any:
    @functools.wraps(original)
    def validate_args(self):
        shadowed = "_setup_mpi_environment" in vars(self)
        saved = vars(self).get("_setup_mpi_environment")
        self._setup_mpi_environment = _nothing
        try:
            return original(self)
        finally:
            if shadowed:
                self._setup_mpi_environment = saved
            else:
                del self._setup_mpi_environment

    return validate_args


FIX = LauncherOpenmpiPrematureEnvCheck()
