"""Command-line interface: `cli/app.py` registers one module per command group."""
