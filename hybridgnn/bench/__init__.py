"""Open-loop load generation and reports."""
