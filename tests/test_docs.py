"""The hand-written text (README.md, docs/*.md; not the generated pages): what a reader copies must work."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WRITTEN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.name)
def test_when_a_page_has_code_blocks_then_each_closes_on_a_line_of_its_own(path: Path) -> None:
    fences = [line for line in path.read_text().splitlines() if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{path.name}: an unclosed code block"
    closing = fences[1::2]
    assert all(line.strip() == "```" for line in closing), f"{path.name}: text after a closing fence: {closing}"


@pytest.mark.parametrize("path", WRITTEN, ids=lambda p: p.name)
def test_when_a_page_shows_an_install_line_then_it_names_a_real_repository(path: Path) -> None:
    repo_url = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nhooks:")[0])["repo_url"]
    for url in re.findall(r"git\+(\S+?)[\"'\s]", path.read_text()):
        assert url == repo_url, f"{path.name}: installs from {url}, the site's repository is {repo_url}"
    assert "<this repository>" not in path.read_text()


def test_when_the_readme_shows_the_differential_summary_then_it_is_what_the_record_prints() -> None:
    from ci import differential
    from ci.differential import design, record, space

    text = (ROOT / "README.md").read_text().split("## Configurations checked", 1)[1]
    shown = text.split("```\n", 2)[1].rstrip("\n").splitlines()
    loaded = space.load()
    printed = differential.summary(record.read(), loaded, design.build(loaded)).splitlines()
    assert shown == [line for line in printed if not line.startswith("    explained by ")
                     and not re.match(r"  [0-9a-f]{10}~[0-9]+ ", line)]  # the per-entry and per-group lines
