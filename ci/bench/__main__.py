"""``python -m ci.bench``: runs ``ci.bench.main`` (the package's docstring says what it does)."""
from . import main

raise SystemExit(main())
