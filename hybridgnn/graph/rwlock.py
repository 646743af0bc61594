"""A readers-writer lock: the dynamic graph's (graph/dynamic.py), held by readers of
rows and embeddings while an update batch is applied under the writer's hold."""

from __future__ import annotations

import threading
from contextlib import contextmanager


class RWLock:
    """Many readers or one writer; a waiting writer holds off new readers."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0

    @contextmanager
    def read(self):
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and not self._writers_waiting)
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                if self._readers == 0:
                    self._cond.notify_all()

    def try_read(self) -> bool:
        """Take a read hold if no writer holds or awaits the lock (then release_read());
        False at once otherwise."""
        with self._cond:
            if self._writer or self._writers_waiting:
                return False
            self._readers += 1
            return True

    def release_read(self) -> None:
        with self._cond:
            self._readers -= 1
            if self._readers == 0:
                self._cond.notify_all()

    @contextmanager
    def write(self):
        with self._cond:
            self._writers_waiting += 1
            self._cond.wait_for(lambda: not self._writer and self._readers == 0)
            self._writers_waiting -= 1
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()
