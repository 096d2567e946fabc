#!/usr/bin/env bash
# The main job: execute every notebook on its release matrix in the project venv, then build the site.
# Run `bash ci/setup.sh notebooks` first. Extra arguments go to the runner (e.g. --entry ID, --jobs 1); with --entry,
# --release or --shard only those notebooks run, and the site (which needs every entry's runs) is not built.
# The other environments' runs (ci/environments.toml: Colab's shape, torch 2.0) are in the tests and in CI, whose
# merged runs the published site is built from; here they run with --env all (after `bash ci/setup.sh matrix`).
set -euo pipefail
cd "$(dirname "$0")/.."
environments=(--env cpu)
part=""
for argument in "$@"; do
  case "$argument" in
    --env|--env=*) environments=() ;;
    --entry|--entry=*|--release|--release=*|--shard|--shard=*) part="$argument" ;;
  esac
done
.venv/bin/python -m ci.notebooks.runner --jobs 2 "${environments[@]}" "$@"  # two notebooks at once (docs/performance.md); a later --jobs wins
if [ -n "$part" ]; then
  echo "site not built: it needs every entry's runs, and this was a part of the matrix ($part)"
  exit 0
fi
.venv/bin/python -m ci.site --mkdocs  # the pages, then the site in the same process: entry pages converted on every core, mkdocs build --strict
echo "site built in site/ (executed notebooks in build/executed/, records in build/results/)"
