"""``python -m ci.site``: runs ``ci.site.main`` (the package's docstring says what it does)."""
from . import main

raise SystemExit(main())
