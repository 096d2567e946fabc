"""The site's "Configurations checked" page and the entry cards' links to it, from a made differential record and
from the recorded one."""
from pathlib import Path

import yaml

from ci.site import checked as page
from fixes import card, checked

ROOT = Path(__file__).resolve().parents[3]
CELL = {"zero_stage": 0, "precision": "fp16-static", "world_size": 1}


def made() -> checked.Record:
    return checked.Record(
        cells={"a": CELL, "b": {**CELL, "zero_stage": 2}, "c": {**CELL, "zero_stage": 1}},
        rows={"a": {"0.18.2": {"verdict": "differs", "max_diff": 0.7, "first_step": 0, "quantity": "parameters"}},
              "b": {"0.18.2": {"verdict": "crashes", "error": "KeyError: 0",
                               "command": "python -m ci.differential --cell b --release 0.18.2"}},
              "c": {"0.18.2": {"verdict": "agrees"}}},
        attribution={"a": {"0.18.2": {"status": "explained", "entries": ["fp16-zero0-loss-scale"]}},
                     "b": {"0.18.2": {"status": "unexplained", "minimised": "not minimised yet"}}},
        checked="2026-12-06 06:12 UTC")


def test_when_the_page_is_made_then_each_release_counts_agree_differ_explained_and_not_explained():
    text = page.checked_page(made())
    assert "| 0.18.2 | 1 | 1 | 1 | 1 | 0 | 1 | 0 | 0 |" in text, text
    assert "[fp16-zero0-loss-scale](entries/fp16-zero0-loss-scale.ipynb) | <a href=\"#cell-a\">a</a> (0.18.2)" in text
    assert ("| <a href=\"#cell-b\">b</a> | 0.18.2 | crashes | KeyError: 0 | not minimised yet | "
            "`python -m ci.differential --cell b --release 0.18.2` |") in text
    assert '<span id="cell-a"></span>`a`' in text and "differs (fp16-zero0-loss-scale)" in text


def test_when_an_unexplained_row_was_minimised_then_its_smallest_configuration_and_range_are_shown():
    record = made()
    minimised = {"b~0": {"cell": "b", "signature": "crashes: KeyError", "rows": ["0.18.2"], "set": {"zero_stage": 2},
                         "releases": {"0.16.0": "agrees", "0.17.0": "crashes: KeyError", "0.18.2": "crashes: KeyError"},
                         "first": "0.17.0", "last": "0.18.2"}}
    text = page.checked_page(checked.Record(record.cells, record.rows, record.attribution, record.checked, minimised))
    assert "| KeyError: 0 | zero_stage=2; crashes: KeyError on 0.17.0 - 0.18.2 (2 of 3 releases) |" in text, text


def test_when_a_minimised_group_has_a_checked_script_then_the_page_links_it_and_the_site_serves_it(tmp_path):
    record = made()
    group = {"cell": "b", "signature": "crashes: KeyError", "rows": ["0.18.2"], "on": "0.18.2",
             "minimal": {"zero_stage": 2, "optimizer": "torch-sgd", "checkpoint": "universal"},
             "set": {"zero_stage": 2, "optimizer": "torch-sgd", "checkpoint": "universal"},
             "releases": {"0.17.0": "agrees", "0.18.2": "crashes: KeyError"}, "first": "0.18.2", "last": "0.18.2",
             "script": {"name": "differential-x.py", "run": {"steps": 4}, "checked": {"0.18.2": "crashes: KeyError",
                                                                                  "0.17.0": "agrees"}, "matches": True}}
    with_script = checked.Record(record.cells, record.rows, record.attribution, record.checked, {"b~0": group},
                                 "2.13.0+cpu", "3.11.7")
    assert page.write_scripts(tmp_path, with_script) == 1
    (name,) = [p.name for p in (tmp_path / page.SCRIPTS).iterdir()]
    text = page.checked_page(with_script)
    assert f"; [script]({page.SCRIPTS}/{name}) |" in text, text
    assert (f"| [{name}]({page.SCRIPTS}/{name}) | zero_stage=2, optimizer=torch-sgd, checkpoint=universal | "
            "0.18.2: crashes: KeyError, 0.17.0: agrees | yes |") in text
    script = (tmp_path / page.SCRIPTS / name).read_text()
    assert "agrees on 0.17.0; crashes: KeyError on 0.18.2" in " ".join(script.split()) and "torch 2.13.0+cpu" in script
    line = checked.Checked("b", group["minimal"], (), record.rows["b"]["0.18.2"], {"status": "unexplained"}, group,
                           f"{card.SITE_URL}{checked.SCRIPTS}").text
    assert line.endswith(f"a script to file upstream: {card.SITE_URL}{checked.SCRIPTS}{name})"), line


def test_when_an_error_names_a_temporary_folder_then_the_page_shows_it_without_directories():
    record = made()
    rows = {**record.rows, "b": {"0.18.2": {"verdict": "crashes", "command": "c",
                                            "error": "AssertionError: /tmp/fixbook-differential-x1/mid seems bogus"}}}
    text = page.checked_page(checked.Record(record.cells, rows, record.attribution, record.checked))
    assert "AssertionError: mid seems bogus" in text and "/tmp/" not in text


def test_when_nothing_is_recorded_then_the_page_says_so():
    assert "No configuration has been checked yet." in page.checked_page(checked.Record())


def test_when_the_site_is_navigated_then_the_page_is_in_the_nav():
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text().split("\nhooks:")[0] + "\n" +
                         "nav:" + (ROOT / "mkdocs.yml").read_text().split("\nnav:")[1])["nav"]
    assert {"Configurations checked": f"generated/{page.PAGE}"} in nav


def test_when_an_entry_explains_recorded_cells_then_its_card_links_them():
    record = checked.read()
    explained = {e for by_release in record.attribution.values() for a in by_release.values()
                 if a.get("status") == "explained" for e in a["entries"]}
    for entry in sorted(explained)[:3]:
        [row] = card.checked_row(fixes_info(entry))
        first_cell, _ = record.showed(entry)[0]
        assert f"generated/checked/#cell-{first_cell}" in row, row


def fixes_info(entry_id: str):
    import fixes

    return fixes.registry.get(entry_id).info
