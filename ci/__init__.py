"""The Fixbook's CI side: release environments, the papermill matrix runner, the site generator."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the checkout: every ci module's paths start here
