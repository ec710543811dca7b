#!/usr/bin/env bash
# The project's checks, as the README's test command and .ci/run both run them: lint and format
# (the files pyproject.toml's [tool.ruff] selects), types (mypy's files), then the test lanes:
# the fast one (the default), the slow one (real multi-process runs, notebook execution) and,
# with --slurm, the Slurm one (a real Slurm on this host; as root it installs slurm-wlm and
# munge with apt-get, else it skips). Run from anywhere, in the environment to be checked.
set -euo pipefail
cd "$(dirname "$0")/.."
lanes=("not slow and not slurm" "slow")
[[ "${1:-}" == "--slurm" ]] && lanes+=("slurm")
ruff check
ruff format --check
mypy
for lane in "${lanes[@]}"; do
    python -m pytest -p no:cacheprovider --durations=20 -m "$lane"
done
