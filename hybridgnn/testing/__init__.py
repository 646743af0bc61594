"""Helpers for tests and bench scripts (not used by the server): raw HTTP exchanges, llhttp
verdicts of byte streams, and the fuzz generators. Needs the `test` extra (hypothesis)."""
