"""Fix for launcher-mpi-exports-quoted: the backport of upstream PR #7071, one wrapper.

``MultiNodeRunner.add_export`` (``deepspeed/launcher/multinode_runner.py``) stores every variable the launcher
forwards as ``self.exports[key] = f'"{value}"'``: the value in double quotes, which a shell (pdsh's ``export K="v";``)
removes and an MPI launcher, which gets the value as a word of its command line (``-x K="v"``, ``-genv K="v"``,
``-genv K '"v"'``, ``-env K="v"``), passes on as it is. The wrapper calls the original, then, where the value has only
the characters upstream's fix leaves unquoted (letters, digits, ``_@%+=:,./-``), stores it without the quotes,
which is what upstream's fix stores; a value with any other character (a space, a parenthesis, a ``$``) stays quoted,
as upstream's fix keeps it (so a shell still reads it as one word).

Apply it in the process that runs the launcher (the ``deepspeed`` command), before it collects the exports:
``python -c "import fixes, sys; fixes.apply('launcher-mpi-exports-quoted'); from deepspeed.launcher.runner import
main; sys.exit(main())" --hostfile ... --launcher openmpi train.py``. It requires
launcher-openmpi-premature-env-check's fix, applied first where that bug is installed, without which the OpenMPI
launcher stops before it collects any export. The probe reads how the installed ``add_export`` stores a value.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.launcher.multinode_runner"
_ADD_EXPORT = Target(_MODULE, "MultiNodeRunner.add_export")
_ALWAYS_QUOTED = re.compile(r"""=\s*f(["'])\\"\{var\.strip\(\)\}\\"\1""")  # = f"\"{var.strip()}\""
_SAFE = re.compile(r"[^\w@%+=:,./-]")  # upstream's test: a value with none of these characters is left unquoted


class LauncherMpiExportsQuoted(Fix):
    targets = (_ADD_EXPORT,)
    requires = ("launcher-openmpi-premature-env-check",)

    def read_code(self) -> Probe:
        runner = getattr(import_target_module(_MODULE), "MultiNodeRunner")
        source = inspect.getsource(vars(runner)["add_export"])
        if _ALWAYS_QUOTED.search(source):
            return Probe(True, "MultiNodeRunner.add_export stores every value in double quotes")
        if "re.search" in source:
            return Probe(False, "MultiNodeRunner.add_export quotes only values with special characters")
        return Probe(False, "MultiNodeRunner.add_export stores the values without quotes")

    def patches(self) -> list[AttributePatch]:
        return [_ADD_EXPORT.wrap(_quoted_where_needed)]


def _quoted_where_needed(original: Any) -> Any:
    @functools.wraps(original)
    def add_export(self, key, var):
        result = original(self, key, var)
        name, value = key.strip(), var.strip()
        if self.exports.get(name) == f'"{value}"' and not _SAFE.search(value):
            self.exports[name] = value
        return result

    return add_export


FIX = LauncherMpiExportsQuoted()
