"""`python -m tokenhaul.cli`, as the `tokenhaul` command."""

from tokenhaul.cli import main

main()
