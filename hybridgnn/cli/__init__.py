"""Command line: `hybridgnn <command>`; one module per command with add_parser and run."""
