"""The entry pages' HTML, converted before ``mkdocs build`` runs, on every core.

mkdocs-jupyter converts each notebook page of the site (nbconvert, then its own clean-up) inside ``mkdocs
build``, one page after another, and keeps each page in its cache (``cache_dir``, ``.cache/mkdocs-jupyter``:
one file per page, named by a hash of the notebook's bytes and the plugin's options) for the next build. On a
new checkout, or after a new run of the notebooks, the cache holds none of them: every page is converted, about
half a second each on 2 cores, while the other core idles. :func:`convert_all` fills the cache first with the
plugin's own functions (its cache key, its conversion, its table of contents), one process per core; mkdocs then
reads each page from the cache (``Cache hit`` in its log) and writes the same site.

    python -m ci.site.notebook_pages   # the pages only; python -m ci.site --mkdocs (ci/build.sh) converts them while
                                       # it writes the other pages, then runs mkdocs build --strict
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from fixes.files import write_atomic

from .. import ROOT

PLUGIN = "mkdocs-jupyter"
MKDOCS_YML = ROOT / "mkdocs.yml"


@dataclass(frozen=True)
class Converted:
    """What :func:`convert_all` did: pages converted now, pages the cache already held."""

    converted: int
    cached: int
    jobs: int


def plugin_config(mkdocs_yml: Path = MKDOCS_YML) -> tuple[Path, dict[str, Any]]:
    """The site's docs directory and mkdocs-jupyter's options as the plugin validates them (its defaults
    filled in), read from ``mkdocs_yml``."""
    import yaml
    from mkdocs_jupyter.plugin import Plugin

    site = yaml.safe_load(mkdocs_yml.read_text())
    options: dict[str, Any] | None = None
    for plugin in site.get("plugins", []):
        if plugin == PLUGIN or (isinstance(plugin, dict) and PLUGIN in plugin):
            options = (plugin[PLUGIN] if isinstance(plugin, dict) else None) or {}
    if options is None:
        raise RuntimeError(f"{mkdocs_yml} uses no {PLUGIN} plugin")
    instance = Plugin()
    errors, _ = instance.load_config(options)
    if errors:
        raise RuntimeError(f"{mkdocs_yml}: {PLUGIN}'s options: {errors}")
    docs = mkdocs_yml.parent / site.get("docs_dir", "docs")
    return docs, dict(instance.config)


def notebook_pages(docs: Path, config: dict[str, Any]) -> list[Path]:
    """The notebooks under ``docs`` that the plugin makes pages of (its ``include`` patterns, less ``ignore``)."""
    found = []
    for path in sorted(docs.rglob("*.ipynb")):
        relative = path.relative_to(docs).as_posix()
        if any(fnmatch.fnmatch(relative, p) for p in config["include"]) and \
                not any(fnmatch.fnmatch(relative, p) for p in config["ignore"]):
            found.append(path)
    return found


def cache_path(notebook: Path, config: dict[str, Any], root: Path = ROOT) -> Path:
    """Where the plugin looks for ``notebook``'s page (its ``_compute_cache_key`` and ``_get_cache_path``)."""
    from mkdocs_jupyter.plugin import _compute_cache_key, _get_cache_path

    directory = Path(config["cache_dir"])
    return _get_cache_path(directory if directory.is_absolute() else root / directory,
                           _compute_cache_key(str(notebook), config, config["execute"]))


_compiled_templates: dict[str, bytes] = {}  # this process's compiled Jinja templates: keep_compiled_templates()


def keep_compiled_templates() -> None:
    """Let every nbconvert exporter of this process reuse the Jinja templates an earlier one compiled. The plugin
    makes a new exporter for each page, whose new Jinja environment compiles nbconvert's templates again: a third
    of a page's time (2.9 of 8.9 s for 8 pages, cProfile). A Jinja bytecode cache in memory holds each compiled
    template with its source's checksum (a changed template compiles again); what a template renders is the same.
    Idempotent."""
    import jinja2
    from nbconvert.exporters.templateexporter import TemplateExporter

    if getattr(TemplateExporter._create_environment, "keeps_compiled_templates", False):
        return

    class InMemory(jinja2.BytecodeCache):
        def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
            if bucket.key in _compiled_templates:
                bucket.bytecode_from_string(_compiled_templates[bucket.key])

        def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
            _compiled_templates[bucket.key] = bucket.bytecode_to_string()

    create = TemplateExporter._create_environment

    def create_environment(self: Any) -> Any:
        environment = create(self)
        environment.bytecode_cache = InMemory()
        return environment

    create_environment.keeps_compiled_templates = True  # type: ignore[attr-defined]
    TemplateExporter._create_environment = create_environment  # type: ignore[method-assign]


def convert(notebook: Path, config: dict[str, Any], root: Path = ROOT) -> bool:
    """Write ``notebook``'s page into the plugin's cache as the plugin's render writes it; False where the cache
    already holds it."""
    from mkdocs_jupyter import convert as plugin_convert
    from mkdocs_jupyter.plugin import _get_nb_toc_tokens

    target = cache_path(notebook, config, root)
    if target.exists():
        return False
    keep_compiled_templates()
    body = plugin_convert.nb2html(
        str(notebook), execute=config["execute"], kernel_name=config["kernel_name"], theme=config["theme"],
        allow_errors=config["allow_errors"], show_input=config["show_input"], no_input=config["no_input"],
        no_prompt=config["no_prompt"], remove_tag_config=config["remove_tag_config"],
        highlight_extra_classes=config["highlight_extra_classes"], include_requirejs=config["include_requirejs"],
        custom_mathjax_url=config["custom_mathjax_url"])
    toc_tokens, title = _get_nb_toc_tokens(str(notebook), config["toc_depth"])
    # whole or not at all: mkdocs may read it next
    write_atomic(target, json.dumps({"content": body, "toc_tokens": toc_tokens, "title": title}))
    return True


def start_converting(mkdocs_yml: Path = MKDOCS_YML, jobs: int | None = None) -> Callable[[], Converted]:
    """Start converting every notebook page of the site whose page the cache lacks, ``jobs`` forked processes at
    once (default: one per core), and return at once: the caller goes on (``python -m ci.site --mkdocs`` writes the
    other pages meanwhile). The function returned waits for the conversions and says what was done; it raises what
    a conversion raised. Nothing is converted where the plugin's cache is off or it executes notebooks itself:
    mkdocs then converts each page as it always does."""
    docs, config = plugin_config(mkdocs_yml)
    jobs = jobs or os.cpu_count() or 1
    if not config["cache"] or config["execute"]:
        return lambda: Converted(0, 0, jobs)
    pages = notebook_pages(docs, config)
    root = mkdocs_yml.parent
    if jobs <= 1 or len(pages) <= 1:
        done = [convert(page, config, root) for page in pages]
        return lambda: Converted(sum(done), len(done) - sum(done), jobs)
    import multiprocessing

    import mkdocs_jupyter.convert  # noqa: F401 - imported once, before the fork, not in every process

    keep_compiled_templates()
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"))
    futures = [pool.submit(convert, page, config, root) for page in pages]

    def wait() -> Converted:
        try:
            done = [future.result() for future in futures]
        finally:
            pool.shutdown(cancel_futures=True)
        return Converted(sum(done), len(done) - sum(done), jobs)

    return wait


def convert_all(mkdocs_yml: Path = MKDOCS_YML, jobs: int | None = None) -> Converted:
    """Convert every notebook page of the site whose page the cache lacks (:func:`start_converting`, waited for)."""
    return start_converting(mkdocs_yml, jobs)()


def mkdocs_build(mkdocs_yml: Path = MKDOCS_YML) -> None:
    """``mkdocs build --strict`` in this process: mkdocs' own command (its logging, its warning filters, its abort
    on a warning), without a new Python that imports mkdocs, its plugins, nbconvert and jsonschema again. Raises
    :class:`RuntimeError` with mkdocs' message where the build fails."""
    import click
    from mkdocs.__main__ import cli

    try:
        cli.main(["build", "--strict", "--config-file", str(mkdocs_yml)], prog_name="mkdocs", standalone_mode=False)
    except click.ClickException as exc:
        raise RuntimeError(f"mkdocs build --strict: {exc.format_message()}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ci.site.notebook_pages", description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="processes at once (default: one per core)")
    args = parser.parse_args(argv)
    try:
        result = convert_all(jobs=args.jobs)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"entry pages: {result.converted} converted, {result.cached} already in mkdocs-jupyter's cache "
          f"({result.jobs} at once)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
