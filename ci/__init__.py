"""The Fixbook's CI side: release environments, the papermill matrix runner, the site generator."""
