"""`python -m fasop` is the `fasop` command."""

from fasop.cli import main

main()
