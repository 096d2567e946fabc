"""ci.clean_machine: the README's commands it times, and the page section its records make."""
from pathlib import Path

import pytest

from ci import clean_machine


def test_when_the_readme_is_read_then_the_commands_are_its_first_two_bash_blocks() -> None:
    commands = clean_machine.readme_commands()
    assert commands["main"].startswith("bash ci/setup.sh notebooks")
    assert commands["tests"] == (Path(__file__).parents[2] / ".ci" / "run").read_text().splitlines()[-1]


def test_when_a_readme_lacks_a_block_then_a_clear_error(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n```bash\nbash ci/setup.sh\n```\n")
    with pytest.raises(ValueError, match="1 bash block"):
        clean_machine.readme_commands(readme)


def test_when_a_mode_is_unknown_then_nothing_is_cloned() -> None:
    with pytest.raises(ValueError, match="unknown mode"):
        clean_machine.measure("everything")


def test_when_records_exist_then_the_page_gives_each_command_its_time_exit_and_load() -> None:
    record = {"command": "bash ci/setup.sh && .venv/bin/python -m pytest", "seconds": 1234.5, "exit": 0,
              "commit": "abc1234", "date": "2026-01-02", "cpus": 2, "load_start": 1.5, "load_mean": None}
    text = "\n".join(clean_machine.page_lines({"tests": record}))
    assert "| Tests: `bash ci/setup.sh && .venv/bin/python -m pytest` | 20 min 34 s (1234.5 s) | 0 | abc1234 |" in text
    assert "not sampled" in text and "Main job" not in text
