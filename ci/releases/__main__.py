"""``python -m ci.releases {install,list,update,report}``: installs and kernels (``ci.releases``), and a new release's
update and report (``ci.releases.update``, which builds on the sweep and the runner)."""
import sys

from . import main
from .update import main as update_main

args = sys.argv[1:]
if not args or args[0] in ("-h", "--help"):
    print("usage: python -m ci.releases {install,list,update,report} [options]\n\n"
          "  install, list      the release set and the sweep's boundary releases: python -m ci.releases install --help\n"
          "  update, report     a new DeepSpeed release on PyPI: python -m ci.releases update --help")
    sys.exit(0 if args else 2)
sys.exit(update_main(args) if args[0] in ("update", "report") else main(args))
