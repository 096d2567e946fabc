"""The GitHub Actions workflows, checked without GitHub: actionlint finds nothing in them, every command they run
is one of this repository's (its modules and options, its scripts, the venv's tools), every action is an
official one (or create-pull-request) pinned to a major version, each sharded job's matrix covers every part
and its merge takes every part, and the README says which workflow does what."""
from __future__ import annotations

import fnmatch
import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ci import ROOT

WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
ACTIONLINT = Path(sys.executable).parent / "actionlint"  # installed into the venv by ci/setup.sh (ci/requirements.txt)
ACTIONS = {"actions/checkout", "actions/setup-python", "actions/upload-artifact", "actions/download-artifact",
           "actions/upload-pages-artifact", "actions/deploy-pages", "actions/configure-pages",
           "peter-evans/create-pull-request"}
SHELL = {"args=()", "for", "do", "done", "args+=(--release", "args+=(--only"}  # the bash the run steps use


def load(path: Path) -> dict:
    data = yaml.safe_load(path.read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as True
    return data


def steps(path: Path):
    for job_id, job in load(path)["jobs"].items():
        for step in job.get("steps", []):
            yield job_id, job, step


def actionlint(*paths: Path) -> subprocess.CompletedProcess:
    assert ACTIONLINT.exists(), f"{ACTIONLINT} is missing: `bash ci/setup.sh` installs it (ci/requirements.txt)"
    return subprocess.run([str(ACTIONLINT), "-no-color", "-config-file", str(ROOT / ".github" / "actionlint.yaml"),
                           *map(str, paths)], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_when_actionlint_checks_the_workflows_then_it_finds_nothing():
    assert len(WORKFLOWS) == 5
    done = actionlint(*WORKFLOWS)
    assert done.returncode == 0, done.stdout + done.stderr


def test_when_a_workflow_is_broken_then_actionlint_says_where(tmp_path):
    broken = tmp_path / "broken.yml"
    broken.write_text((ROOT / ".github" / "workflows" / "tests.yml").read_text()
                      .replace("${{ matrix.shard }}/${{ strategy.job-total }}", "${{ matrix.part }}/4", 1))
    done = actionlint(broken)
    assert done.returncode == 1 and 'property "part" is not defined' in done.stdout, done.stdout


def commands(script: str) -> list[list[str]]:
    """The simple commands of a run step's bash (``${{ }}`` expressions and ``$VAR`` words kept as words)."""
    script = re.sub(r"\$\{\{[^}]*\}\}", "EXPR", script.replace("\\\n", " "))
    found = []
    for line in script.splitlines():
        for part in re.split(r"&&|\|\||;|\|", line):
            words = shlex.split(part, comments=True)
            if words:
                found.append(words)
    return found


def run_steps() -> list[tuple[str, str, list[str]]]:
    return [(path.name, job_id, words) for path in WORKFLOWS for job_id, _, step in steps(path)
            if "run" in step for words in commands(step["run"])]


def _help(module: str, words: list[str]) -> str:
    """``python -m module [subcommand] --help``: the subcommand where the module's help offers it as a choice."""
    top = _run_help(module)
    choices = set(re.findall(r"\{([a-z,-]+)\}", top)[0].split(",")) if "{" in top else set()
    sub = [w for w in words if not w.startswith("-")][:1]
    return _run_help(module, sub[0]) if sub and sub[0] in choices else top


@functools.cache
def _run_help(module: str, sub: str = "") -> str:
    done = subprocess.run([sys.executable, "-m", module, *([sub] if sub else []), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"python -m {module} {sub} --help failed: {done.stderr[-500:]}"
    return done.stdout


def test_when_a_workflow_runs_a_command_then_the_repository_has_it_with_every_option_it_passes():
    checked = set()
    for workflow, job, words in run_steps():
        where = f"{workflow} ({job}): {' '.join(words)}"
        program = words[0]
        if program in SHELL or "=" in program:
            continue
        if program in (".venv/bin/python", "python", "python3"):
            assert words[1] == "-m", where
            module = words[2]
            if module.startswith("ci."):
                path = ROOT / module.replace(".", "/")
                assert path.with_suffix(".py").is_file() or (path / "__main__.py").is_file(), f"{where}: no module {module}"
            help_text = _help(module, words[3:])
            for flag in (w.split("=")[0] for w in words[3:] if w.startswith("--")):
                assert re.search(rf"(^|[\s\[,]){re.escape(flag)}\b", help_text), f"{where}: {module} has no {flag}"
            sub = [w for w in words[3:] if not w.startswith("-") and w != "EXPR"][:1]
            if module in ("ci.releases", "ci.sweep.new_release"):  # a verb first, one of those the help offers
                assert sub and sub[0] in re.findall(r"\{([a-z,]+)\}", help_text)[0].split(","), where
            checked.add(module)
        elif program == "bash":
            assert (ROOT / words[1]).is_file(), f"{where}: no script {words[1]}"
            if words[1] == "ci/setup.sh" and len(words) > 2:
                assert words[2] in ("notebooks", "matrix"), f"{where}: ci/setup.sh takes no scope {words[2]}"
            checked.add(words[1])
        elif program.startswith(".venv/bin/"):
            assert (ROOT / program).exists(), f"{where}: the venv has no {program} (ci/requirements.txt)"
            checked.add(program)
        else:
            pytest.fail(f"{where}: {program} is not a command of this repository")
    assert {"ci.notebooks.runner", "ci.sweep", "ci.sweep.new_release", "ci.notebooks.claims", "ci.site", "ci.tools.device",
            "pytest", "ci/setup.sh", ".venv/bin/mkdocs"} <= checked


def test_when_a_workflow_uses_an_action_then_it_is_an_official_one_pinned_to_a_major_version():
    used = set()
    for path in WORKFLOWS:
        for job_id, _, step in steps(path):
            if "uses" in step:
                name, _, version = step["uses"].partition("@")
                assert name in ACTIONS, f"{path.name} ({job_id}) uses {step['uses']}, not an official action"
                assert re.fullmatch(r"v\d+", version), f"{path.name} ({job_id}): {step['uses']} is not pinned to a major"
                used.add(name)
    assert used == ACTIONS


def sharded_jobs() -> list[tuple[str, str, dict]]:
    return [(path.name, job_id, job) for path in WORKFLOWS for job_id, job in load(path)["jobs"].items()
            if any(re.search(r"--shard\s", step.get("run", "")) for step in job.get("steps", []))]


def test_when_a_job_runs_in_parts_then_its_matrix_covers_every_part_and_its_merge_takes_every_part():
    jobs = sharded_jobs()
    assert {(workflow, job_id) for workflow, job_id, _ in jobs} == {("tests.yml", "notebooks"),
                                                                      ("release-update.yml", "parts"),
                                                                      ("differential.yml", "parts")}
    for workflow, job_id, job in jobs:
        matrix = job["strategy"]["matrix"]
        assert set(matrix) == {"shard"}, f"{workflow} {job_id}: one dimension, so strategy.job-total is N"
        count = len(matrix["shard"])
        assert matrix["shard"] == list(range(1, count + 1)) and count > 1, f"{workflow} {job_id}: parts 1 ... N"
        assert job["strategy"]["fail-fast"] is False  # a failing part never cancels the others' runs
        for step in job["steps"]:
            for shard in re.findall(r"--shard\s+(\"[^\"]*\"|\S+)", step.get("run", "")):
                assert shard == '"${{ matrix.shard }}/${{ strategy.job-total }}"', f"{workflow} {job_id}: {shard}"
        uploaded = [step["with"]["name"] for step in job["steps"] if step.get("uses", "").startswith(
            "actions/upload-artifact")]
        assert len(uploaded) == 1 and "${{ matrix.shard }}" in uploaded[0]
        names = [uploaded[0].replace("${{ matrix.shard }}", str(i)) for i in matrix["shard"]]
        mergers = [(other_id, other) for other_id, other in load(ROOT / ".github" / "workflows" / workflow)["jobs"].items()
                   if job_id in ([other.get("needs")] if isinstance(other.get("needs"), str) else other.get("needs", []))]
        assert mergers, f"{workflow}: no job needs {job_id}"
        for other_id, other in mergers:
            patterns = [step["with"]["pattern"] for step in other["steps"]
                        if step.get("uses", "").startswith("actions/download-artifact")]
            assert patterns and all(fnmatch.fnmatch(name, patterns[0]) for name in names), (other_id, patterns)
            merges = [step["run"] for step in other["steps"] if "--merge" in step.get("run", "")]
            assert merges and all(f"parts/{patterns[0]}" in run for run in merges), (other_id, merges)
        text = (ROOT / ".github" / "workflows" / workflow).read_text()
        planned = [int(n) for n in re.findall(r"--shards (\d+)", text)]  # a plan printed for the same parts
        assert all(n == count for n in planned), f"{workflow}: --shards {planned} but {count} parts"


def test_when_the_readme_tells_of_the_workflows_then_it_names_each_and_what_it_does():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## GitHub Actions workflows", 1)[1].split("\n## ", 1)[0]
    for path in WORKFLOWS:
        assert f"`.github/workflows/{path.name}`" in section, f"the README's workflows section leaves out {path.name}"
    named = set(re.findall(r"\.github/workflows/([\w-]+\.yml)", section))
    assert named == {path.name for path in WORKFLOWS}


def test_when_ci_run_is_read_then_it_is_the_readme_s_test_command_then_its_main_job_and_the_notebook_tests_on_its_build():
    readme = (ROOT / "README.md").read_text()
    command = "bash ci/setup.sh && .venv/bin/python -m pytest"
    notebook_tests = "FIXBOOK_BUILD=build FIXBOOK_MATRIX=main .venv/bin/python -m pytest -m notebooks"
    assert f"```bash\n{command}\n```" in readme and f"`{notebook_tests}`" in readme
    lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert lines[-3:] == [command, "bash ci/build.sh", notebook_tests]  # the main job's set-up is in the tests' one
