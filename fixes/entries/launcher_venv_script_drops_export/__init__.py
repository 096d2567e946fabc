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

from ...fix import Fix, FixInfo, Probe
from ...patching import AttributePatch, Target, import_target_module

_MODULE = "deepspeed.launcher.multinode_runner"
_GET_CMD = Target(_MODULE, "PDSHRunner.get_cmd")
# the buggy word: `source <script>` with the closing quote right after it, no `;` before the exports
_NO_SEPARATOR = re.compile(r"""source \{self\.args\.venv_script\}["']""")
_WITH_SEPARATOR = re.compile(r"""source \{self\.args\.venv_script\};["']""")


class LauncherVenvScriptDropsExport(Fix):
    info = FixInfo(
        id="launcher-venv-script-drops-export",
        title="deepspeed --venv_script drops the first exported variable from the pdsh command",
        summary=("A multi-node job launched with `deepspeed --hostfile ... --venv_script <activate script>` (the "
                 "pdsh launcher, DeepSpeed's default for several nodes) loses one environment variable on every "
                 "node: the first of those DeepSpeed exports to the nodes (the launching shell's PYTHON*, MLFLOW*, "
                 "UCX*, MV2*, and on CUDA NCCL* variables, DeepSpeed's own PYTHONPATH, then the lines of "
                 ".deepspeed_env). The command pdsh runs on each node reads `source <script> export VAR=value; "
                 "export ...`: with no `;` after the script, `export VAR=value` become arguments of `source`, so "
                 "VAR is never set, while every later export is. The ranks start without it and nothing says so: "
                 "a tracking URI, an NCCL setting or a PYTHONPATH silently does not apply."),
        symptom="silent wrong result",
        components=("launcher",),
        error_signatures=(
            "source foo.sh export NCCL_NET_PLUGIN=blah;",
            "deepspeed --venv_script first export ignored",
            "environment variable not set on worker nodes with --venv_script",
            "one exported variable missing on the other nodes, the others arrive",
            "pdsh command missing ';' after source venv script",
            "NCCL env var not applied on remote nodes with deepspeed launcher",
            "PYTHONPATH not set on the ranks with --venv_script",
        ),
        root_cause=("deepspeed/launcher/multinode_runner.py, PDSHRunner.get_cmd: with --venv_script it puts "
                    "f\"source {self.args.venv_script}\" in front of the exports string (\"export K=V; export ...; "
                    "\") without a ';', and pdsh joins the words with spaces, so each node's shell runs `source "
                    "<script> export K=V; export ...`: `export K=V` become positional arguments of `source`, and "
                    "the first exported variable is never set. deepspeed/launcher/runner.py, main, builds the "
                    "exports (PDSHRunner.add_export) from the launching environment's EXPORT_ENVS-prefixed "
                    "variables (PYTHONPATH always, which main sets) and then .deepspeed_env, so the variable lost "
                    "is one of the former."),
        reproduce_release="0.17.2",
        upstream_fixed_in="0.17.5",
        upstream_prs=(7469,),
        upstream_note=("Fixed by PR #7469 ('fix `deepspeed --venv_script`'), in 0.17.5: the word becomes "
                       "f\"source {self.args.venv_script};\". The PR has no test."),
    )
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
