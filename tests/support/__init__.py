"""Helpers shared by the tests and the bench scripts (not shipped in the wheel, not used by
the server): server processes, an in-process engine client, small graphs, reference results,
raw HTTP exchanges, llhttp verdicts of byte streams, and the fuzz generators. Needs the
`test` extra (pytest, hypothesis). Import as `tests.support.<module>` with the repository
root on sys.path (pytest and `python -m` from the root put it there; bench scripts insert it)."""
