"""``python -m hybridfleet`` is the ``hfleet`` command."""

from hybridfleet.cli.app import main

main()
