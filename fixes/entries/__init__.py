"""The entries: one subpackage per bug, named after its id (``-`` → ``_``).

Each holds its fix in ``__init__.py`` (``FIX``, light imports only: listing and probing entries
never imports torch, DeepSpeed or the harness) and its reproduction in ``reproduce.py`` (imported
only by the sweep, the tests and the notebook), with any module only this entry needs beside it.
"""
