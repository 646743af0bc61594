"""Undo records that make one update batch all or nothing.

Every in-place write of an apply is preceded by a record of what it overwrites (rows of
an array, or an attribute: a scalar or an array reference that growth replaces);
`rollback` replays them in reverse, leaving the state byte-identical to before the batch.
Growth allocates new arrays, so restoring the old reference undoes it. Recording costs
what the batch touches, never the size of the graph.

`fault_point(step)` marks the steps of an apply; tests install FAULT to raise at any of
them and check that the rollback is complete.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

FAULT: Callable[[str], None] | None = None  # test hook: called at each step of an apply


def fault_point(step: str) -> None:
    if FAULT is not None:
        FAULT(step)


class Journal:
    def __init__(self):
        self._undo: list[tuple] = []

    def attrs(self, obj, *names: str) -> None:
        """Remember obj.<name> (a scalar, or the array object itself) for each name."""
        for name in names:
            self._undo.append((obj, name, getattr(obj, name)))

    def rows(self, array: np.ndarray, index, old: np.ndarray | None = None) -> None:
        """Remember array[index] (rows about to be overwritten in place); `old`: those rows,
        when the caller has already read them (saves a second gather). The index must not
        be changed afterwards."""
        if len(index):
            self._undo.append((array, index, array[index] if old is None else old))

    def rollback(self) -> None:
        for target, key, old in reversed(self._undo):
            if isinstance(key, str):
                setattr(target, key, old)
            else:
                target[key] = old
        self._undo.clear()


def maybe(journal: Journal | None):
    """The journal, or a stand-in that records nothing (applies outside a transaction)."""
    return journal if journal is not None else _NO_JOURNAL


class _NoJournal(Journal):
    def attrs(self, obj, *names: str) -> None:
        pass

    def rows(self, array, index, old=None) -> None:
        pass


_NO_JOURNAL = _NoJournal()
