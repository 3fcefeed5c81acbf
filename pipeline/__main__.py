"""`python -m pipeline ...`: the CLI without an installed entry point (e.g. a build server that
puts the checkout on PYTHONPATH)."""

from pipeline.cli import app

app()
