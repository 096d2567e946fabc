"""Running the notebooks: the papermill matrix runner and what checks and shares its runs.

Owns ``runner.py`` (``python -m ci.notebooks.runner``: every entry's notebook on each release of its matrix),
``shards.py`` (the matrix and the sweep cut into parts for machines side by side), ``claims.py``
(``python -m ci.notebooks.claims``: the claim cells' outputs against their references) and ``colab.py``
(``python -m ci.notebooks.colab``: the notebooks' Colab set-up cell).

May import: ``ci.releases``, ``ci.processes``, and ``fixes``.
"""
