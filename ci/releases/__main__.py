"""``python -m ci.releases {install,list}``: the release set and its kernels (``ci.releases``). A new release on PyPI
(``update``, ``report``) builds on the sweep and the runner, so it lives above them: ``python -m ci.sweep.new_release``."""
import sys

from . import main

sys.exit(main())
