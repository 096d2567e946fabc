"""``python -m ci.differential``: see :mod:`ci.differential`."""
import sys

from . import main

sys.exit(main())
