"""The site: generated pages, a search index that holds what users paste and not the chatter,
and a real browser finding entries by error text (screenshots kept in build/screenshots/)."""
import functools
import html
import http.server
import json
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import nbformat
import pytest

import fixes
from ci import releases, site
from fixes import search as search_module
from ci.site.mkdocs_hooks import SHARED_MIN_CHARS, exclude_from_search, share_styles
from tests.helpers import made_once

ROOT = Path(__file__).resolve().parents[3]
SCREENSHOTS = ROOT / "build" / "screenshots"
CHROMIUM = "/usr/bin/chromium"
SEARCHES = {
    "SplitBackward0": "zero12-flat-buffer-detach",
    "Output 0 of Split is a view": "zero12-flat-buffer-detach",
    "must override the setup_context staticmethod": "zero3-linear-setup-context",
}


def explaining(query: str) -> set[str]:
    """Every entry whose error signatures contain ``query``: several entries can share one error."""
    return {fix.id for fix in fixes.all_fixes()
            if any(query.lower() in signature.lower() for signature in fix.info.error_signatures)}


def test_when_outputs_hold_chatter_then_the_page_copy_drops_it_and_keeps_results():
    cell = nbformat.v4.new_code_cell("x")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stderr", text="/usr/bin/ld: cannot find -laio\ncollect2: error\n"),
        nbformat.v4.new_output("stream", name="stdout",
                               text="[2026-11-21 22:31:55,934] [WARNING] [engine.py:1] untested\nReproduced: boom\n"),
    ]
    notebook = nbformat.v4.new_notebook(cells=[cell])
    cleaned = site.clean_outputs(notebook).cells[0].outputs
    assert [o["text"] for o in cleaned] == ["Reproduced: boom\n"]


def test_when_page_html_is_indexed_then_code_chrome_and_long_outputs_are_excluded():
    long = "\n".join(f"row {i}" for i in range(10))
    html = ('<div class="highlight-ipynb hl-python"><pre>import fixes</pre></div>'
            '<div class="jp-InputPrompt jp-InputArea-prompt">In [1]:</div>'
            f'<div class="jp-RenderedText jp-OutputArea-output" data-mime-type="text/plain"><pre>{long}</pre></div>'
            '<div class="jp-RenderedText jp-OutputArea-output" data-mime-type="text/plain"><pre>short</pre></div>')
    marked = exclude_from_search(html)
    assert '<pre data-search-exclude>import fixes' in marked
    assert '<div data-search-exclude class="jp-InputPrompt' in marked
    assert f"<pre data-search-exclude>{long}" in marked
    assert "<pre>short</pre>" in marked


def test_when_an_entry_page_carries_its_style_sheets_then_it_links_one_shared_file_each_and_keeps_small_ones():
    theme = ".jp-Cell{color:red}" * SHARED_MIN_CHARS
    html = (f'<style type="text/css">{theme}</style><p>prose</p><style>.x{{margin:0}}</style>'
            f'<div><style type="text/css">{theme}</style></div>')
    shared: dict[str, str] = {}
    page = share_styles(html, "generated/entries/an-entry/", shared)
    [(name, sheet)] = shared.items()
    assert sheet == theme and name.endswith(".css")
    link = f'<link rel="stylesheet" href="../../../assets/notebook/{name}">'
    assert page == f"{link}<p>prose</p><style>.x{{margin:0}}</style><div>{link}</div>"
    assert share_styles(html, "index.html", {}).startswith(f'<link rel="stylesheet" href="assets/notebook/{name}">')


def test_when_a_cell_displays_code_as_its_output_then_the_code_is_excluded_and_prose_output_is_kept():
    # harness.show_code displays the user's script as Markdown: rendered as a highlighted block in the output.
    html = ('<div class="jp-RenderedHTMLCommon jp-RenderedMarkdown jp-OutputArea-output" data-mime-type="text/markdown">'
            '\n<div class="highlight"><pre><span class="k">def</span> user_script():</pre></div></div>'
            '<div class="jp-RenderedHTMLCommon jp-RenderedMarkdown jp-OutputArea-output" data-mime-type="text/markdown">'
            '\n<p>Reproduced: the weights differ.</p></div>')
    marked = exclude_from_search(html)
    assert '<div class="highlight"><pre data-search-exclude><span class="k">def</span>' in marked
    assert "<p>Reproduced: the weights differ.</p>" in marked


def test_when_the_pages_are_made_from_the_committed_data_then_no_card_or_index_page_names_a_machine_path():
    import re

    from fixes import card

    absolute = re.compile(r"(?<![\w.])/(?:home|work|tmp|root|Users|mnt|opt|var)/[^\s\"'<)]*")
    pages = {"coverage": site.coverage_page(), "matrix": site.matrix_page(), "components": site.components_page(),
             "bisect": site.bisect_page()}
    pages.update({info.id: card.card(info) + site.header_markdown(info) + site.recheck_markdown(info)
                  for info in (fix.info for fix in fixes.all_fixes())})
    # An upstream commit subject the Coverage page quotes may name a path of upstream's machines ("Get rocm version
    # from /opt/rocm/.info/version"): upstream's words, never this machine's, which the checks below still catch.
    quoted = {path for row in json.loads(search_module.UPSTREAM_FIXES.read_text())["rows"]
              for path in absolute.findall(row["subject"])}
    assert not any(path.startswith((str(site.ROOT), str(Path.home()), tempfile.gettempdir())) for path in quoted)
    found = {name: [path for path in absolute.findall(text) if path not in quoted]
             for name, text in pages.items()}
    found = {name: paths for name, paths in found.items() if paths}
    assert not found, found


def test_when_outputs_hold_machine_paths_then_the_page_copy_shows_them_as_a_reader_would():
    cell = nbformat.v4.new_code_cell("x")
    temp = tempfile.mkdtemp(prefix="zero-to-fp32-")
    cell.outputs = [
        nbformat.v4.new_output("stream", name="stdout", text=(
            f"{ROOT}/.deepspeed/0.17.6/deepspeed/runtime/engine.py: DeepSpeedEngine.backward\n"
            f"saved {temp}/checkpoint/global_step2/mp_rank_00_model_states.pt\n")),
        nbformat.v4.new_output("error", ename="IndexError", evalue="list index out of range", traceback=[
            f'File {sys.base_prefix}/lib/python3.11/contextlib.py:81', f"File {ROOT}/fixes/fix.py:12"]),
        nbformat.v4.new_output("execute_result", data={"text/plain": f"'{sys.prefix}/lib/python3.11/site-packages/torch'"},
                               execution_count=1),
    ]
    cleaned = site.clean_outputs(nbformat.v4.new_notebook(cells=[cell])).cells[0].outputs
    assert cleaned[0]["text"] == ("site-packages/deepspeed/runtime/engine.py: DeepSpeedEngine.backward\n"
                                  "saved checkpoint/global_step2/mp_rank_00_model_states.pt\n")
    assert cleaned[1]["traceback"] == ["File python3.11/contextlib.py:81", "File fixes/fix.py:12"]
    assert cleaned[2]["data"]["text/plain"] == "'site-packages/torch'"


@pytest.fixture(scope="session")
def built_site(matrix_build, tmp_path_factory):
    """The real mkdocs build (strict) of the pages generated from the shared notebook run."""
    build, _ = matrix_build

    def make(project: Path) -> Path:
        shutil.copy(ROOT / "mkdocs.yml", project / "mkdocs.yml")
        shutil.copytree(ROOT / "docs", project / "docs", ignore=shutil.ignore_patterns("generated"))
        (project / "ci" / "site").mkdir(parents=True)
        shutil.copy(ROOT / "ci" / "site" / "mkdocs_hooks.py", project / "ci" / "site")
        site.generate(build, out=project / "docs" / "generated")
        done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(project / "mkdocs.yml")],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return project / "site"

    return made_once(tmp_path_factory, "site", make)


def test_when_site_is_built_then_the_search_index_is_small_and_holds_every_error_signature(built_site):
    index = built_site / "search" / "search_index.json"
    text = " ".join(doc["text"] for doc in json.loads(index.read_text())["docs"])
    # A budget per entry (its prose, metadata header and short outputs; long outputs and code are
    # excluded by ci/site/mkdocs_hooks.py), plus the hand-written pages. Measured: 10.1 KB per entry with 11; 12.4 KB
    # with 51 (654,016 bytes), once each card also carried the older releases' and other environments' rows, where
    # the fix was measured (the accelerators) and upstream's test with its measured reason.
    budget = 13_000 * len(fixes.available()) + 20_000
    assert index.stat().st_size < budget, f"search index grew to {index.stat().st_size} bytes (budget {budget})"
    for fix in fixes.all_fixes():
        for signature in fix.info.error_signatures:
            # The index holds each page's text as HTML: "&&" is stored as "&amp;&amp;".
            assert html.escape(signature, quote=False) in text, f"{fix.id}: {signature!r} is not searchable"
    for noise in ("cannot find -laio", "[rank0]", "Copied!", "FutureWarning"):
        assert noise not in text, f"{noise!r} leaked into the search index"


def test_when_site_is_built_then_no_page_shows_a_path_of_this_machine(built_site):
    machine = {str(ROOT), tempfile.gettempdir().rstrip("/") + "/", sys.prefix, sys.base_prefix}
    for page in [*built_site.rglob("*.html"), *built_site.rglob("*.ipynb"), built_site / "search" / "search_index.json"]:
        text = page.read_text(errors="replace")
        found = sorted(path for path in machine if path in text)
        assert not found, f"{page.relative_to(built_site)} shows {found}"


def test_when_site_is_built_then_every_link_within_it_leads_to_a_page(built_site):
    import re
    from urllib.parse import urlparse

    from fixes.card import SITE_URL

    prefix = urlparse(SITE_URL).path  # absolute links (the 404 page's) carry the site's path
    broken = {}
    for page in built_site.rglob("*.html"):
        for link in re.findall(r'(?:href|src)="([^"]+)"', page.read_text(errors="replace")):
            path = link.split("#")[0].split("?")[0]
            if not path or re.match(r"^[a-z][a-z0-9+.-]*:|^//", path):
                continue  # an anchor on the page, another site
            target = built_site / path.removeprefix(prefix) if path.startswith("/") else page.parent / path
            if not (target.is_file() or (target / "index.html").is_file()):
                broken.setdefault(link, []).append(str(page.relative_to(built_site)))
    assert not broken, {link: pages[:3] for link, pages in broken.items()}


@pytest.fixture(scope="session")
def site_url(built_site):
    handler = functools.partial(QuietHandler, directory=str(built_site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: `bash ci/setup.sh` installs Debian's chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # The flags keep Chromium off the network (this machine has none) and work as root.
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        yield browser
        browser.close()


@pytest.mark.parametrize(("query", "entry"), list(SEARCHES.items()))
def test_when_error_text_is_typed_into_search_then_the_first_result_is_an_entry_it_names(browser, site_url, query, entry):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(site_url)
    page.click("input.md-search__input")
    page.locator("input.md-search__input").press_sequentially(query, delay=10)
    page.wait_for_selector(".md-search-result__item", timeout=30_000)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"search-{entry}-{len(query)}.png"))
    page.locator(".md-search-result__item > a").first.click()
    page.wait_for_load_state()
    assert entry in explaining(query)
    [landed] = [e for e in explaining(query) if f"/generated/entries/{e}/" in page.url] or [page.url]
    assert fixes.get(landed).info.title in page.inner_text("h1")
    page.close()


def test_when_status_page_opens_then_every_entry_has_a_row_with_its_measured_status(browser, site_url, matrix_build):
    page = browser.new_page(viewport={"width": 1600, "height": 900})
    page.goto(site_url + "generated/status/")
    rows = page.locator("table tbody tr")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "status.png"), full_page=True)
    texts = [rows.nth(i).inner_text() for i in range(rows.count())]
    assert len(texts) == len(fixes.available())
    newest = releases.load().newest
    for fix in fixes.all_fixes():
        [row] = [text for text in texts if fix.info.title in text]
        # the run columns, after entry, symptom, measured range and first fixed (whose words, and a title quoting an
        # error such as "... load failed", are no run's status)
        statuses = row.split("\t")[4:]
        assert "reproduced → fixed" in statuses, row  # on its reproduce release
        assert ("not affected" in statuses) == (fix.info.expected_affected(newest) is False
                                                and (fix.id, newest, "cpu") in matrix_build[1]), row
        assert not any("failed" in cell or "not reproduced" in cell for cell in statuses), row
    page.close()


def test_when_the_site_url_is_read_then_mkdocs_and_the_package_agree():
    import re

    from fixes.card import SITE_URL

    assert re.search(r"^site_url:\s*(\S+)\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE).group(1) == SITE_URL


def test_when_an_entry_page_is_made_then_injected_parameters_and_the_card_cell_are_dropped(tmp_path):
    info = fixes.get("zero2-offload-multi-backward").info
    notebook = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(f"# {info.title}"),
        nbformat.v4.new_code_cell('results_file = "/work/main/build/results/x.json"',
                                  metadata={"tags": ["injected-parameters"]}),
        nbformat.v4.new_code_cell('fixes.card.show("x")', metadata={"tags": ["entry-card"]}),
        nbformat.v4.new_code_cell("print('kept')")])
    executed = tmp_path / "executed.ipynb"
    nbformat.write(notebook, executed)
    from fixes.record import RunResult

    run = RunResult(info.id, info.reproduce_release, "k", "n", str(executed), "passed", 1.0)
    page = nbformat.read(site.entry_page(info, {info.reproduce_release: run}, tmp_path), as_version=4)
    text = "\n".join(cell.source for cell in page.cells)
    assert "/work/" not in text and "fixes.card.show" not in text and "print('kept')" in text
    assert page.cells[0].source.startswith(f"# {info.title}") and "Fix works (measured)" in page.cells[0].source
    again = tmp_path / "again"
    again.mkdir()
    assert site.entry_page(info, {info.reproduce_release: run}, again).read_bytes() == \
        (tmp_path / f"{info.id}.ipynb").read_bytes()  # the same page, byte for byte: mkdocs-jupyter's cache finds it


def test_when_a_release_page_opens_then_its_list_is_the_sweep_s(browser, site_url):
    release = "0.18.3"
    expected = sorted(fix.info.title for fix in fixes.all_fixes() if fix.info.expected_affected(release))
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(site_url + f"generated/releases/{release}/")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / f"release-{release}.png"), full_page=True)
    assert f"DeepSpeed {release}: {len(expected)} known bug" in page.inner_text("h1")
    rows = page.locator("table tbody tr")
    titles = sorted(rows.nth(i).locator("td").first.inner_text() for i in range(rows.count()))
    assert titles == expected
    page.close()


def _typed_search(browser, site_url, query):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(site_url)
    page.wait_for_function("window.fixbookMatchReady === true", timeout=30_000)
    page.click("input.md-search__input")
    page.locator("input.md-search__input").fill(query)
    page.locator("input.md-search__input").press("End")
    page.wait_for_selector("#fixbook-verdict", timeout=30_000)
    return page


def test_when_an_unrelated_error_is_typed_into_search_then_no_entry_is_presented_as_a_match(browser, site_url):
    page = _typed_search(browser, site_url, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB.")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "search-unrelated.png"))
    verdict = page.inner_text("#fixbook-verdict")
    assert "no match" in verdict and page.locator("#fixbook-verdict [data-level=strong]").count() == 0, verdict
    page.close()


def test_when_the_labelled_queries_go_through_the_site_matcher_then_it_answers_as_fixbook_search(browser, site_url):
    from fixes.cli import search

    queries = [(q["name"], q["query"]) for q in
               json.loads((ROOT / "tests" / "fixes" / "data" / "search_queries.json").read_text())]
    queries += [(f"{r['entry']}: {r['source']}", r["text"]) for r in  # users' own words: prose ranking too
                json.loads((ROOT / "tests" / "fixes" / "data" / "user_reports.json").read_text())["reports"]]
    page = browser.new_page()
    page.goto(site_url)
    page.wait_for_function("window.fixbookMatchReady === true", timeout=30_000)
    for name, text in queries:
        site_answer = page.evaluate("text => window.fixbookMatch(text)", text)
        cli_answer = [{"id": m.fix_id, "level": m.level} for m in search(text)]
        assert site_answer == cli_answer, name
    page.close()


def test_when_the_coverage_page_opens_then_its_counts_are_the_data_s(browser, site_url):
    counts = site.coverage_counts()
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(site_url + "generated/coverage/")
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "coverage.png"))
    for key, element in (("rows", "census-rows"), ("user_visible", "census-visible"), ("backlog", "census-backlog"),
                         ("entries", "census-entries")):
        assert page.inner_text(f"#{element}") == str(counts[key]), key
    shown = {page.locator(".triage-count").nth(i).get_attribute("data-status"): int(page.locator(".triage-count").nth(i).inner_text())
             for i in range(page.locator(".triage-count").count())}
    assert shown == counts["triage"]
    cells = page.locator(".triage-cell")
    by_component: dict[str, dict[str, int]] = {}
    for i in range(cells.count()):
        cell = cells.nth(i)
        count = int(cell.inner_text())
        if count:
            by_component.setdefault(cell.get_attribute("data-component"), {})[cell.get_attribute("data-status")] = count
    assert by_component == counts["triage_by_component"]
    page.close()


def test_when_a_page_copy_is_made_then_progress_redraws_and_memory_reports_leave_with_their_heading():
    text = ("begin bf16_optimizer\nMA 0.4 GB         Max_MA 0.4 GB \nCPU Virtual Memory:  used = 2.08 GB\n"
            "Δ 1.51e-02\n\rLoading checkpoint shards:   0%|\rLoading checkpoint shards: 100%|\nverified\n")
    kept = site.drop_chatter(text)
    assert "Δ 1.51e-02\n" in kept and kept.endswith("verified\n")
    for chatter in ("begin bf16_optimizer", "MA 0.4", "CPU Virtual Memory", "checkpoint shards"):
        assert chatter not in kept, chatter


def test_when_the_performance_page_or_a_release_grid_is_rendered_then_its_tables_stay_out_of_the_search_index():
    from types import SimpleNamespace

    from ci.site import mkdocs_hooks

    def page(uri):
        return SimpleNamespace(file=SimpleNamespace(src_uri=uri))

    html_ = "<h2>What a fix costs</h2><table>\n<tr><td>741.65</td></tr></table><pre>x</pre>"
    out = mkdocs_hooks.on_page_content(html_, page("performance.md"), None, None)
    assert "<table data-search-exclude>" in out and "<h2>What a fix costs</h2>" in out
    for grid in ("generated/releases/index.md", "generated/matrix.md"):  # release x entry grids: the entry pages say it
        assert "<table data-search-exclude>" in mkdocs_hooks.on_page_content(html_, page(grid), None, None)
    assert "<table>" in mkdocs_hooks.on_page_content(html_, page("recheck.md"), None, None)


BEHAVIOUR_CHANGE = "gradient-clipping-default-1"  # an entry of kind "behaviour change" (FixInfo.kind)


def test_when_the_status_table_is_made_then_behaviour_changes_have_a_table_apart_from_bugs():
    text = site.status_table({})
    bugs_at, changes_at = text.index("## Bugs"), text.index("## Behaviour changes")
    for fix in fixes.all_fixes():
        row = text.index(f"](entries/{fix.id}.ipynb) |")
        if fix.info.is_behaviour_change:
            assert row > changes_at and "| behaviour change · " in text[row:text.index("\n", row)], fix.id
        else:
            assert bugs_at < row < changes_at, fix.id
    assert fixes.get(BEHAVIOUR_CHANGE).info.is_behaviour_change


def test_when_a_release_has_a_behaviour_change_then_its_page_lists_it_apart_and_does_not_count_it_as_a_bug():
    info = fixes.get(BEHAVIOUR_CHANGE).info
    release = info.reproduce_release
    assert info.expected_affected(release), "the sweep has not measured the behaviour change on its release"
    page = site.release_page(release, [release])
    title = page.splitlines()[next(i for i, line in enumerate(page.splitlines()) if line.startswith("# "))]
    assert f": {len(site.known_bugs(release))} known bug" in title and info not in site.known_bugs(release)
    section = page[page.index("## Behaviour changes"):]
    assert f"](../entries/{info.id}.ipynb)" in section and info.apply_call in section
    assert f"](../entries/{info.id}.ipynb)" not in page[:page.index("## Behaviour changes")]


def test_when_a_behaviour_change_s_card_is_made_then_it_says_so_instead_of_a_symptom():
    from fixes import card

    info = fixes.get(BEHAVIOUR_CHANGE).info
    text = card.card(info, runs=[])
    assert text.startswith("**behaviour change** · ") and f"**{info.symptom}**" not in text
    assert "| **Kind** | behaviour change" in text and "Has the new behaviour (measured)" in text
    bug = card.card(fixes.get("zero-to-fp32-empty-weights").info, runs=[])
    assert bug.startswith("**silent wrong result** · ") and "**Kind**" not in bug
