"""Developer tools, apart from the flow: the import-graph check, the new-entry scaffold, the CUDA-machine bundle.

Owns ``imports.py`` (``python -m ci.tools.imports``: the layering of ``fixes`` and the order of the ci packages),
``new_entry.py`` (``python -m ci.tools.new_entry``) and ``device.py`` (``python -m ci.tools.device``).

May import: any ci package and ``fixes``; no other ci package imports this one.
"""
