"""The Fixbook's CI side, one package per step of the flow it serves, lowest first:

* ``ci.processes`` — how a Python process under a release starts (zygote, kernel server, kernels);
* ``ci.releases`` — the DeepSpeed releases and the other environments: installs, kernels, the set-up plan;
* ``ci.notebooks`` — running the notebooks: the papermill matrix runner, shards, claims, the Colab cell;
* ``ci.sweep`` — measuring releases: the sweep, the triggers' grids, fingerprints, a new release on PyPI;
* ``ci.differential`` — the differential sweep: a covering grid of job configurations on every release against
  plain PyTorch;
* ``ci.triage`` — the upstream census and its triage with upstream's own tests;
* ``ci.site`` — publishing: the generated pages and the MkDocs hook;
* ``ci.bench`` — benchmarks: what a fix and the tools cost;

and, apart, ``ci.tools`` (the import check, the new-entry scaffold, the CUDA-machine bundle), which may import any.
A package imports only packages before it in this list (``python -m ci.tools.imports`` checks it, with the order
in ``ci.tools.imports.CI_ORDER``); ``fixes`` never imports ``ci``.
"""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: every ci module's paths start here
