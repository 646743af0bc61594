"""External node ids (sparse int64 or strings, as a user's data names its nodes) and the
dense internal ids 0..n-1 the graph is stored by.

Internal id i is the i-th smallest external id, so the map is one sorted array
(`node_ids.npy` beside the dataset, memory-mapped): external -> internal is a binary
search, internal -> external an index. Strings are stored as fixed-width unicode (no
pickle)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ID_MAP_FILE = "node_ids.npy"


class IdMap:
    def __init__(self, external: np.ndarray):
        if external.dtype.kind not in "iU":
            raise ValueError(f"external ids must be int64 or strings, got {external.dtype}")
        self.external = external

    @property
    def kind(self) -> str:
        """'int64' or 'string': the datatype requests name nodes with (INT64 or BYTES)."""
        return "string" if self.external.dtype.kind == "U" else "int64"

    def __len__(self) -> int:
        return int(self.external.shape[0])

    @classmethod
    def build(cls, ids: np.ndarray) -> tuple[IdMap, np.ndarray]:
        """The map of every distinct id in `ids`, and `ids` as internal ids."""
        external, internal = np.unique(ids, return_inverse=True)
        return cls(external), internal.astype(np.int64).reshape(np.shape(ids))

    @classmethod
    def load(cls, dataset_dir: str | Path) -> IdMap | None:
        path = Path(dataset_dir) / ID_MAP_FILE
        return cls(np.load(path, mmap_mode="r", allow_pickle=False)) if path.is_file() else None

    def save(self, dataset_dir: str | Path) -> Path:
        path = Path(dataset_dir) / ID_MAP_FILE
        np.save(path, self.external, allow_pickle=False)
        return path

    def to_internal(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(internal ids, known mask): unknown values get -1."""
        values = np.asarray(values)
        pos = np.searchsorted(self.external, values)
        pos = np.minimum(pos, len(self) - 1) if len(self) else np.zeros(values.shape, dtype=np.int64)
        known = (self.external[pos] == values) if len(self) else np.zeros(values.shape, dtype=bool)
        return np.where(known, pos, -1).astype(np.int64), known

    def to_external(self, internal: np.ndarray) -> np.ndarray:
        return np.asarray(self.external[np.asarray(internal, dtype=np.int64)])
