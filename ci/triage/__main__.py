"""``python -m ci.triage``: runs ``ci.triage.main`` (the package's docstring says what it does)."""
from . import main

raise SystemExit(main())
