"""``python -m ci.sweep``: runs ``ci.sweep.main`` (the package's docstring says what it does)."""
from . import main

raise SystemExit(main())
