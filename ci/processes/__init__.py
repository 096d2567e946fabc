"""How a Python process under a release starts: the lowest of the ci packages.

Owns the zygote (``zygote.py``: a Python that has imported torch and forks each command), the kernel server
(``kernel_server.py``: one per kernel, forking notebook kernels and launched ranks) and the notebook kernels the
runner asks for (``kernels.py``). ``zygote.py`` and ``kernel_server.py`` are also run as scripts by path, by a
release's or an environment's own Python, so at their top they import the standard library only (the kernel server
reads ``fixes.harness.launch.PRELOAD`` once it runs, to import what the harness's ranks import).

May import: no other ci package; ``fixes`` (its harness) only from inside a function.
"""
