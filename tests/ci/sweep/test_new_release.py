"""A new release on the index: ``python -m ci.sweep.new_release update`` and ``report``."""
import dataclasses
import re
import shutil

import pytest

from ci import releases
from ci.sweep import new_release as release_update
from fixes import measured


def fake_index(root, versions: list[str]) -> str:
    """A package index on disk (PEP 503, what pip's index query reads) listing DeepSpeed ``versions``."""
    page = root / "simple" / "deepspeed"
    page.mkdir(parents=True)
    links = "".join(f'<a href="deepspeed-{v}.tar.gz">deepspeed-{v}.tar.gz</a>\n' for v in versions)
    (page / "index.html").write_text(f"<html><body>\n{links}</body></html>\n")
    return (root / "simple").as_uri()


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    """ci/releases.toml as a copy of this test's own, and an index with one release newer than its newest."""
    copy = tmp_path / "releases.toml"
    shutil.copy(releases.RELEASES_FILE, copy)
    monkeypatch.setattr(releases, "RELEASES_FILE", copy)
    newest = releases.load().newest
    major, minor, patch = (int(p) for p in newest.split("."))
    new = f"{major}.{minor}.{patch + 1}"
    url = fake_index(tmp_path, ["0.16.0", newest, new, f"{major}.{minor + 1}.0rc1"])  # a pre-release is never added
    return copy, newest, new, url


def swept(new: str, before: str, path) -> tuple[object, list[str]]:
    """The committed sweep plus rows for ``new``: each entry as on ``before``, except that the first two bugs
    present there are fixed in ``new``. Returns the file and those two."""
    import fixes

    data = measured.load()
    bugs = [f.id for f in fixes.all_fixes() if f.info.kind == "bug" and data.entry(f.id).expected_affected(before)]
    rows = {}
    for entry, sweep_ in data.results.items():
        row = sweep_.get(before)
        if row is not None:
            row = dataclasses.replace(row, release=new)
            rows[entry] = dataclasses.replace(row, status="not affected", fix=None) if entry in bugs[:2] else row
    results = {e: measured.EntrySweep(e, {**s.observations, **({new: rows[e]} if e in rows else {})})
               for e, s in data.results.items()}
    measured.write(dataclasses.replace(data, releases=[*data.releases, new], results=results), path)
    return path, bugs


def test_when_the_index_has_a_newer_release_then_update_adds_it_plans_its_sweep_and_writes_the_pull_request(
        checkout, tmp_path, capsys):
    copy, before, new, url = checkout
    sweep_file, bugs = swept(new, before, tmp_path / "sweep.json")
    pr, outputs = tmp_path / "pr.md", tmp_path / "outputs"
    assert release_update.main(["update", "--index-url", url, "--sweep", str(sweep_file), "--pr", str(pr),
                          "--shards", "3", "--outputs", str(outputs)]) == 0
    assert releases.load().newest == new and releases.load().releases[-1] == new
    out = capsys.readouterr().out
    import fixes

    rows = len(fixes.available())
    assert f"the sweep: {rows} rows (every entry on {new}) in 3 part(s)" in out
    parts = [int(n) for n in re.findall(r"part \d/3: (\d+) rows \(balanced by ", out)]
    assert len(parts) == 3 and sum(parts) == rows
    line = f"{new}: {len(bugs) - 2} of {len(bugs)} bugs still present, 2 fixed"
    assert f"- {line} (of those present on {before})" in pr.read_text()
    assert f"fixed in {new}: `{bugs[0]}`, `{bugs[1]}`" in pr.read_text()
    assert outputs.read_text() == f"releases={new}\ntitle=DeepSpeed {new}: {line.partition(': ')[2]}\n"
    # a second look finds nothing new and changes nothing
    text = copy.read_text()
    assert release_update.main(["update", "--index-url", url]) == 0
    assert f"nothing to add: no DeepSpeed release newer than {new}" in capsys.readouterr().out
    assert copy.read_text() == text


def test_when_update_is_a_dry_run_then_releases_toml_is_unchanged_and_the_text_says_what_is_not_swept(
        checkout, tmp_path, capsys):
    copy, before, new, url = checkout
    text = copy.read_text()
    assert release_update.main(["update", "--dry-run", "--index-url", url, "--pr", str(tmp_path / "pr.md")]) == 0
    assert copy.read_text() == text
    out = capsys.readouterr().out
    assert f'--dry-run: releases.toml would read:\n  newest = "{new}"' in out
    import fixes

    rows = len(fixes.available())
    for i in (1, 2, 3):  # the committed file has no seconds for the new release: dealt by count
        assert f"part {i}/3: {len(range(i - 1, rows, 3))} rows (balanced by count)" in out
    assert f"{new}: not swept yet" in (tmp_path / "pr.md").read_text()


def test_when_check_finds_a_new_release_then_it_only_names_it_for_the_workflow(checkout, tmp_path, capsys):
    copy, before, new, url = checkout
    text = copy.read_text()
    assert release_update.main(["update", "--check", "--index-url", url, "--outputs", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out").read_text() == f"releases={new}\n" and copy.read_text() == text
    assert "the sweep" not in capsys.readouterr().out


@pytest.mark.parametrize("bad", ["0.19", "latest", "0.20.0rc1"])
def test_when_a_given_release_is_not_a_release_number_then_update_refuses_naming_it(bad, checkout, capsys):
    assert release_update.main(["update", "--release", bad, "--dry-run"]) == 2
    assert f"not a final DeepSpeed release number: {bad!r}" in capsys.readouterr().err


def test_when_the_index_cannot_be_asked_then_update_says_so(checkout, tmp_path, capsys):
    assert release_update.main(["update", "--index-url", (tmp_path / "nowhere").as_uri()]) == 2
    assert "pip index versions deepspeed" in capsys.readouterr().err


def test_when_the_readme_gets_the_sweep_summary_then_only_its_block_changes():
    text = release_update.README.read_text()
    block = release_update.SUMMARY_BLOCK.search(text).group(2)
    changed = release_update.readme_with_summary(text, "1 entries x 1 releases")
    assert "as committed it printed:\n\n```\n1 entries x 1 releases\n```" in changed
    assert changed.replace("1 entries x 1 releases", block) == text
    with pytest.raises(release_update.UpdateError, match="as committed it printed"):
        release_update.readme_with_summary("no such block", "x")


def test_when_the_merged_runs_hold_a_failed_notebook_then_the_report_names_it(checkout, tmp_path, capsys):
    import json

    from fixes.record import RunResult

    copy, before, new, url = checkout
    sweep_file, bugs = swept(new, before, tmp_path / "sweep.json")
    build = tmp_path / "build"
    for entry, status in (("a", "passed"), ("b", "failed")):
        result = RunResult(entry, new, "k", "nb", "out", status, 1.0, error="AssertionError: no bug" if status == "failed"
                           else None, failed_cell=7 if status == "failed" else None)
        (build / "results" / entry).mkdir(parents=True)
        (build / "results" / entry / f"{new}.json").write_text(json.dumps(result.to_json()))
    pr = tmp_path / "pr.md"
    assert release_update.main(["report", "--release", new, "--sweep", str(sweep_file), "--build", str(build),
                          "--pr", str(pr)]) == 0
    text = pr.read_text()
    assert f"- 2 notebook runs of the matrix (2 on {new}): 1 passed, 1 failed" in text
    assert f"  - `b` on {new} (cpu): cell 7: AssertionError: no bug" in text
    assert f"{new}: {len(bugs) - 2} of {len(bugs)} bugs still present, 2 fixed" in text
    assert release_update.main(["report", "--release", new, "--sweep", str(tmp_path / "none.json")]) == 2
    assert "no sweep file" in capsys.readouterr().err


