"""External node ids (sparse int64 or strings, as a user's data names its nodes) and the
dense internal ids 0..n-1 the graph is stored by.

Internal id i is the i-th smallest external id, so the map is one sorted array
(`node_ids.npy` beside the dataset, memory-mapped): external -> internal is a binary
search, internal -> external an index. Strings are stored as fixed-width unicode (no
pickle). Nodes added by graph updates take the next internal ids; their external ids
live in a second, small map (`extend`), which the update log restores on replay."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

ID_MAP_FILE = "node_ids.npy"


class IdMap:
    def __init__(self, external: np.ndarray):
        if external.dtype.kind not in "iU":
            raise ValueError(f"external ids must be int64 or strings, got {external.dtype}")
        self.external = external
        # Nodes added since import: (external ids by internal id - len(external), the same
        # sorted, their internal ids in that order). Replaced whole on extend, so a reader
        # on another thread sees the old tuple or the new one, never a mix.
        empty = external[:0]
        self._added = (empty, empty, np.empty(0, np.int64))

    @property
    def kind(self) -> str:
        """'int64' or 'string': the datatype requests name nodes with (INT64 or BYTES)."""
        return "string" if self.external.dtype.kind == "U" else "int64"

    def __len__(self) -> int:
        return int(self.external.shape[0]) + int(self._added[0].shape[0])

    def same_kind(self, values: np.ndarray) -> bool:
        """Whether `values` are ids of this map's kind (strings for a string map)."""
        return (np.asarray(values).dtype.kind == "U") == (self.kind == "string")

    @property
    def max_new_name_chars(self) -> int | None:
        """The longest name a node added by an update may have (None: integer ids): the
        widest imported name, or 64. Added names are stored at the width of the longest,
        so one long name among many short ones made every one of them take its width."""
        if self.kind != "string":
            return None
        return max(64, self.external.dtype.itemsize // 4)

    def extend(self, new_external: np.ndarray) -> None:
        """Name the next len(new_external) internal ids (nodes a graph update added). The
        caller has checked they are distinct and unknown. The new names are merged into
        the sorted ones (linear), not sorted again with them (n log n per update)."""
        new_external = np.asarray(new_external)
        if not len(new_external):
            return
        added, added_sorted, added_internal = self._added
        new = new_external.astype(np.str_ if self.kind == "string" else np.int64)
        ext = np.concatenate([added, new])  # by internal id; wide enough for both
        order = np.argsort(new, kind="stable")
        new_sorted = new[order].astype(ext.dtype)
        new_internal = int(self.external.shape[0]) + len(added) + order.astype(np.int64)
        at = np.searchsorted(added_sorted, new_sorted)
        self._added = (ext, np.insert(added_sorted.astype(ext.dtype), at, new_sorted),
                       np.insert(added_internal, at, new_internal))

    def mark(self) -> tuple:
        """The added names as they are now, for rewind()."""
        return self._added

    def rewind(self, mark: tuple) -> None:
        """Forget the names added since mark() (an apply that failed after naming them)."""
        self._added = mark

    @classmethod
    def build(cls, ids: np.ndarray) -> tuple[IdMap, np.ndarray]:
        """The map of every distinct id in `ids`, and `ids` as internal ids."""
        external, internal = np.unique(ids, return_inverse=True)
        return cls(external), internal.astype(np.int64).reshape(np.shape(ids))

    @classmethod
    def load(cls, dataset_dir: str | Path) -> IdMap | None:
        """The map stored in dataset_dir (None when it has none); ValueError saying why
        when the file is not one: unreadable, or not one strictly increasing 1-D array
        (lookups binary-search it, so unsorted or repeated ids would name other nodes)."""
        path = Path(dataset_dir) / ID_MAP_FILE
        if not path.is_file():
            return None
        try:
            external = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, EOFError) as exc:
            raise ValueError(f"cannot read it ({type(exc).__name__}: {exc})") from exc
        except ValueError as exc:
            with open(path, "rb") as f:
                header = f.read(6) == b"\x93NUMPY"
            # numpy calls a file without the header pickled and advises loading it unsafely
            raise ValueError(f"not a readable .npy array ({exc})" if header else
                             "not a readable .npy array: it has no .npy header (damaged or overwritten?)") from exc
        if external.ndim != 1:
            raise ValueError(f"it must be 1-D (one external id per node), got shape {external.shape}")
        if external.dtype.kind in "iU" and external.shape[0] > 1 and not bool(np.all(external[1:] > external[:-1])):
            raise ValueError("its ids must be distinct and in increasing order (as `hybridgnn dataset import` "
                             "writes them)")
        return cls(external)

    def save(self, dataset_dir: str | Path) -> Path:
        path = Path(dataset_dir) / ID_MAP_FILE
        np.save(path, self.external, allow_pickle=False)
        return path

    def to_internal(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(internal ids, known mask): unknown values get -1."""
        values = np.asarray(values)
        internal, known = _lookup(self.external, None, values)
        added, added_sorted, added_internal = self._added
        if len(added) and not known.all():
            more, more_known = _lookup(added_sorted, added_internal, values)
            internal = np.where(known, internal, more)
            known = known | more_known
        return internal, known

    def to_external(self, internal: np.ndarray) -> np.ndarray:
        internal = np.asarray(internal, dtype=np.int64)
        base = int(self.external.shape[0])
        added = self._added[0]
        if not len(added) or not (internal >= base).any():
            return np.asarray(self.external[internal])
        out = np.empty(internal.shape, dtype=np.result_type(self.external.dtype, added.dtype))
        old = internal < base
        out[old] = self.external[internal[old]]
        out[~old] = added[internal[~old] - base]
        return out


def _lookup(sorted_ext: np.ndarray, internal_of: np.ndarray | None, values: np.ndarray):
    """Binary search of values in sorted_ext: (internal ids, -1 if unknown; known mask);
    internal_of maps positions to internal ids (None: the position is the id)."""
    n = int(sorted_ext.shape[0])
    if not n:
        return np.full(values.shape, -1, np.int64), np.zeros(values.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(sorted_ext, values), n - 1)
    known = sorted_ext[pos] == values
    ids = pos if internal_of is None else internal_of[pos]
    return np.where(known, ids, -1).astype(np.int64), known


def namer(id_map: IdMap | None) -> Callable[[int], str]:
    """How a message names internal node i: as the client does (its name, quoted, or its
    own integer id) on a dataset with a map, else i. An id the map does not name yet (a
    node the batch being checked adds) stays i."""
    if id_map is None:
        return str

    def name(i: int) -> str:
        if not 0 <= i < len(id_map):
            return str(i)
        value = id_map.to_external(np.array([i], dtype=np.int64))[0].item()
        return repr(value) if isinstance(value, str) else str(value)

    return name
