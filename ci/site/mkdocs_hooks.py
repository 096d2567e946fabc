"""mkdocs hooks: keep the search index to what users search for.

On entry pages, code (each input is rendered twice: highlighted, and as the copy button's text; and code a cell
displays as its output, the user's script shown by ``harness.show_code``),
the notebook chrome (prompts, cell tags) and long outputs (tables, environment dumps) stay on the page but get ``data-search-exclude``,
which mkdocs-material's search skips. The header (title, summary, error signatures), the prose and
short outputs (the reproduced error line, the verdicts) stay searchable. Measured records stay on the page and out of
the index too, as on the Performance page: an output whose every line is a comparison within tolerance ("max abs
diff 1.2e-04 (within float16 tolerance ...)"), and the card's rows of run records (where the notebook passed, the
trigger's measured grid, upstream's own test run): nobody pastes those into a search box, and at 37 entries they
were a fifth of the index.

The attribute goes on elements with no descendant of the same tag (``<pre>``, the copy-text
``<div>``): material's search parser compares elements by tag name, so the first nested
``</div>`` inside an excluded ``<div>`` would end the exclusion.

An entry page's notebook carries its style sheets inline: nbconvert's JupyterLab theme (about 570 KB) and the
highlighting rules, the same on every entry page. Each page links them instead (``assets/notebook/<hash>.css``, named
by their content, written once into the site): a page is a quarter of its size, a reader's browser fetches the sheets
once for every entry, and the search plugin does not parse them on each page.
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

from mkdocs.utils import get_relative_url

MAX_INDEXED_OUTPUT_LINES = 6
_CODE = re.compile(r'(<div class="highlight-ipynb [^"]*">)<pre>')
# Leaf elements of the notebook chrome: prompts ("In [3]:"), cell tags, the copy button's text.
_CHROME = re.compile(r'<(div|span) class="(clipboard-copy-txt|jp-InputPrompt|jp-OutputPrompt|cell-tag|notice)\b')
_OUTPUT = re.compile(r'(<div class="jp-RenderedText jp-OutputArea-output"[^>]*>\s*)<pre>(.*?)</pre>', re.S)
# Code a cell displays as its output (``harness.show_code``: the user's script, as a Markdown code block).
_OUTPUT_CODE = re.compile(r'(<div class="jp-RenderedHTMLCommon jp-RenderedMarkdown jp-OutputArea-output"[^>]*>\s*'
                          r'<div class="highlight">)<pre>')


# An output line that reports a measurement against a tolerance, not an error a user would paste.
_MEASURED_LINE = re.compile(r"max abs diff|within \w+ tolerance|largest difference after the fix")
# The card's rows of run records (fixes/card.py): their first cell.
_RECORD_ROW = re.compile(r'<tr>(?=\s*<td><strong>(Notebook passed|Trigger measured|Upstream(&#39;|\')s own test))')


def _is_measurement(text: str) -> bool:
    lines = [line for line in text.splitlines() if line.strip()]
    return bool(lines) and all(_MEASURED_LINE.search(line) for line in lines)


def exclude_from_search(html: str) -> str:
    html = _CODE.sub(r"\1<pre data-search-exclude>", html)
    html = _OUTPUT_CODE.sub(r"\1<pre data-search-exclude>", html)
    html = _CHROME.sub(r'<\1 data-search-exclude class="\2', html)

    html = _RECORD_ROW.sub("<tr data-search-exclude>", html)

    def mark(match: re.Match) -> str:
        if match.group(2).count("\n") < MAX_INDEXED_OUTPUT_LINES and not _is_measurement(match.group(2)):
            return match.group(0)
        return f"{match.group(1)}<pre data-search-exclude>{match.group(2)}</pre>"

    return _OUTPUT.sub(mark, html)


_MARKDOWN_CODE = re.compile(r'<pre(?=[ >])(?! data-search-exclude)')


_TABLE = re.compile(r'<table(?=[ >])(?! data-search-exclude)')
# Pages whose tables stay out of the index: measured figures (nobody searches for "741.65"), and the sweep's
# grids of releases x entry ids, which repeat what each entry's own page says (the release list alone was
# 16 KB of the index at 28 entries: an error pasted into search should find entry pages, not grids).
TABLE_PAGES = ("performance.md", "generated/releases/index.md", "generated/matrix.md")


SHARED_CSS = "assets/notebook"  # where the entry pages' shared style sheets go in the site
SHARED_MIN_CHARS = 2000  # a smaller inline sheet stays where it is
_STYLE = re.compile(r'<style(?: type="text/css")?>(.*?)</style>', re.S)
_shared: dict[str, str] = {}  # file name -> style sheet, written by on_post_build


def share_styles(html: str, page_url: str, shared: dict[str, str]) -> str:
    """``html`` with each inline style sheet of at least :data:`SHARED_MIN_CHARS` characters replaced by a link to a
    file named by its content under :data:`SHARED_CSS` (relative to the page at ``page_url``), added to ``shared``.
    The link stands where the sheet stood, so the cascade is the same."""
    def link(match: re.Match) -> str:
        sheet = match.group(1)
        if len(sheet) < SHARED_MIN_CHARS:
            return match.group(0)
        name = hashlib.sha256(sheet.encode()).hexdigest()[:16] + ".css"
        shared[name] = sheet
        return f'<link rel="stylesheet" href="{get_relative_url(f"{SHARED_CSS}/{name}", page_url)}">'

    return _STYLE.sub(link, html)


def on_page_content(html: str, page, config, files) -> str:  # noqa: ARG001 - mkdocs hook signature
    if page.file.src_uri.startswith("generated/entries/"):
        return exclude_from_search(share_styles(html, page.url, _shared))
    if page.file.src_uri in TABLE_PAGES:  # its headings and prose stay searchable, its tables do not
        html = _TABLE.sub("<table data-search-exclude", html)
    # Elsewhere code blocks (a script, a command's output) stay on the page but out of the index.
    return _MARKDOWN_CODE.sub("<pre data-search-exclude", html)


def on_pre_build(config) -> None:  # noqa: ARG001 - mkdocs hook signature
    """A new build links only the sheets its own pages carry (a process may build the site more than once)."""
    _shared.clear()


def on_post_build(config) -> None:
    """Write the style sheets the entry pages link (:func:`share_styles`)."""
    directory = Path(config["site_dir"]) / SHARED_CSS
    directory.mkdir(parents=True, exist_ok=True)
    for name, sheet in _shared.items():
        (directory / name).write_text(sheet, encoding="utf-8")
