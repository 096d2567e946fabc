"""Fix for launcher-venv-script-drops-export: the backport of upstream PR #7469, one wrapper.

``PDSHRunner.get_cmd`` (``deepspeed/launcher/multinode_runner.py``) returns the pdsh command as a list of words,
``pdsh <options> <hosts>`` followed by the line every node's shell runs. With ``--venv_script`` its first word is
``source <script>``, and the next is the ``export K=V; export ...; `` string, with no ``;`` between them. The
wrapper calls the original and puts the ``;`` on that one word, ``source <script>;``, which is what upstream's fix
writes; nothing else of the command (the exports, the kill command, the environment) changes. Without
``--venv_script`` it returns the original's answer as it is.

Apply it in the process that runs the launcher (the ``deepspeed`` command), before the launcher builds its
command: ``python -c "import fixes, sys; fixes.apply('launcher-venv-script-drops-export'); from
deepspeed.launcher.runner import main; sys.exit(main())" --hostfile ... --venv_script ... train.py``. The method is
looked up when the command is built, so it may be applied any time before. The probe reads the word the installed
``get_cmd`` builds for ``--venv_script``.
"""
from __future__ import annotations

import functools
import inspect
import re
from typing import Any

from ...fix import Fix, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.launcher.multinode_runner"
_GET_CMD = Target(_MODULE, "PDSHRunner.get_cmd")
# the buggy word: `source <script>` with the closing quote right after it, no `;` before the exports
_NO_SEPARATOR = re.compile(r"""source \{self\.args\.venv_script\}["']""")
_WITH_SEPARATOR = re.compile(r"""source \{self\.args\.venv_script\};["']""")


class LauncherVenvScriptDropsExport(Fix):
    targets = (_GET_CMD,)

    def read_code(self) -> Probe:
        runner = getattr(import_target_module(_MODULE), "PDSHRunner")
        source = inspect.getsource(vars(runner)["get_cmd"])
        if _NO_SEPARATOR.search(source):
            return Probe(True, "PDSHRunner.get_cmd puts `source <venv_script>` before the exports without a ';'")
        if _WITH_SEPARATOR.search(source):
            return Probe(False, "PDSHRunner.get_cmd ends `source <venv_script>;` with a ';'")
        if "venv_script" not in source:
            return Probe(False, "PDSHRunner.get_cmd has no --venv_script")
        return Probe(False, "PDSHRunner.get_cmd builds the --venv_script word some other way; no `source "
                            "<venv_script>` without a ';' in it")

    def patches(self) -> list[AttributePatch]:
        return [_GET_CMD.wrap(_separated)]


def _separated(original: Any) -> Any:
    @functools.wraps(original)
    def get_cmd(self, environment, active_resources):
        result = original(self, environment, active_resources)
        script = getattr(self.args, "venv_script", None)
        if script is None:
            return result
        cmd, *rest = result
        word = f"source {script}"
        cmd = list(cmd)
        if word in cmd:  # the first word after pdsh's own options (a user's word with a space is quoted)
            cmd[cmd.index(word)] = f"{word};"
        return (cmd, *rest)

    return get_cmd


FIX = LauncherVenvScriptDropsExport()
