"""`python -m fasop` is the `fasop` command."""

from fasop.cli import run

run()
