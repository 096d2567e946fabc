"""ci/build.sh, the main job: what it asks of the runner, and when it builds the site."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from ci import ROOT


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """ci/build.sh in a tree whose venv's python and mkdocs write down how they were called."""
    (tmp_path / "ci").mkdir()
    shutil.copy(ROOT / "ci" / "build.sh", tmp_path / "ci" / "build.sh")
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("python", "mkdocs"):
        (bin_dir / name).write_text(f'#!/usr/bin/env bash\necho "{name} $*" >> "$(dirname "$0")/../../calls.txt"\n')
        (bin_dir / name).chmod(0o755)
    return tmp_path


def calls(checkout: Path, *arguments: str) -> list[str]:
    done = subprocess.run(["bash", str(checkout / "ci" / "build.sh"), *arguments], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return (checkout / "calls.txt").read_text().splitlines()


def test_when_the_main_job_runs_then_the_runner_gets_the_project_venvs_runs_and_the_site_is_built(checkout):
    assert calls(checkout) == ["python -m ci.notebooks.runner --jobs 2 --env cpu", "python -m ci.site --mkdocs"]


def test_when_an_environment_is_named_then_it_replaces_the_project_venv_default(checkout):
    assert calls(checkout, "--env", "all")[0] == "python -m ci.notebooks.runner --jobs 2 --env all"


def test_when_a_part_of_the_matrix_is_asked_for_then_only_the_runner_runs(checkout):
    assert calls(checkout, "--entry", "some-bug") == ["python -m ci.notebooks.runner --jobs 2 --env cpu --entry some-bug"]
