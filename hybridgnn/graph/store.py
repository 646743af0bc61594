"""The on-disk dataset: a directory of .npy arrays plus meta.json, opened with mmap.

Layout (all arrays little-endian .npy):
    meta.json        name, num_nodes, num_edges, feature_dim, num_classes, fingerprint, ...
    indptr.npy       int64 [N+1]   CSR row pointers; row i lists the neighbours i aggregates from
    indices.npy      int32 [E]     (int64 when N >= 2^31) neighbour ids, sorted and unique per row
    features.npy     float32 [N, F]
    labels.npy       int64 [N]     optional (-1 = unlabelled)
    {train,val,test}_mask.npy  bool [N]  optional
    workload/        PSGS and FAP tables (hybridgnn.workload)

Opening maps the arrays read-only, so every process and thread that opens the same
directory shares one copy in the page cache; nothing is copied per worker.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hybridgnn.config import read_json
from hybridgnn.errors import ConfigError
from hybridgnn.graph.idmap import ID_MAP_FILE, IdMap

FORMAT_VERSION = 1
MASK_NAMES = ("train_mask", "val_mask", "test_mask")


class DatasetError(ConfigError):
    """A dataset directory is missing, incomplete or inconsistent."""


# What numpy raises for a .npy or .npz file that is truncated, corrupt or not one at all.
UNREADABLE_ARRAY = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error)


def written_by_torch_save(path: Path) -> bool:
    """Whether a file starts as torch.save writes one: a zip (a pickle before torch 1.6).
    A text file or noise fails torch.load with messages such as "101" (a KeyError)."""
    with open(path, "rb") as f:
        head = f.read(2)
    return head == b"PK" or head[:1] == b"\x80"


def _check_claimed_sizes(path: Path) -> None:
    with open(path, "rb") as f:
        check_claimed_sizes(f, os.fstat(f.fileno()).st_size, str(path))


def check_claimed_sizes(f, size: int, what: str) -> None:
    """DatasetError unless every array header in the .npy or .npz that binary file f
    (of size bytes) holds claims no more bytes than the file (or its archive member) holds:
    numpy allocates what a header claims before it reads, so a 100-byte file claiming 16 TiB
    was a MemoryError traceback (and one claiming less than the memory, that much memory
    taken before the read failed). Leaves f at its start."""
    if zipfile.is_zipfile(f):
        f.seek(0)
        with zipfile.ZipFile(f) as archive:
            for info in archive.infolist():
                if info.filename.endswith(".npy"):
                    with archive.open(info) as member:
                        _check_header(member, info.file_size, f"{what} ({info.filename})")
    else:
        f.seek(0)
        _check_header(f, size, what)
    f.seek(0)


def _check_header(f, size: int, what: str) -> None:
    if f.read(6) != b"\x93NUMPY":
        return  # np.load says what it is
    f.seek(0)
    version = np.lib.format.read_magic(f)
    reader = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(version)
    if reader is None:
        return  # a format version numpy reads and checks itself
    shape, _, dtype = reader(f)
    claimed = math.prod(shape) * dtype.itemsize
    held = size - f.tell()
    if claimed > held:
        raise DatasetError(f"{what}: its header claims an array of shape {shape} of {dtype} ({claimed:,} bytes), but "
                           f"the file holds {max(held, 0):,} bytes after it (truncated or damaged?)")


def load_arrays(path: Path) -> dict[str, np.ndarray] | np.ndarray:
    """A user's .npy (its array) or .npz (its arrays by name), read whole without pickle;
    DatasetError in one line when the file is not a readable one, or claims arrays larger
    than it holds or than memory holds."""
    try:
        _check_claimed_sizes(path)
        with open(path, "rb") as f:
            loaded = np.load(f, allow_pickle=False)
            if isinstance(loaded, np.lib.npyio.NpzFile):
                with loaded:
                    return {k: loaded[k] for k in loaded.files}
            return loaded
    except DatasetError:
        raise
    except UNREADABLE_ARRAY as exc:
        try:
            with open(path, "rb") as f:
                magic = f.read(6)
        except OSError:
            magic = b""
        if magic and magic != b"\x93NUMPY" and not magic.startswith(b"PK"):
            # numpy calls any such file pickled and advises loading it unsafely
            raise DatasetError(f"{path}: not a readable {Path(path).suffix or 'numpy'} file (it has no .npy or "
                               ".npz header: damaged or overwritten?)") from exc
        raise DatasetError(f"{path}: not a readable {Path(path).suffix or 'numpy'} file "
                           f"({type(exc).__name__}: {exc})") from exc
    except MemoryError:
        raise DatasetError(f"{path}: its arrays do not fit in memory") from None


def hash_csr(h, indptr: np.ndarray, indices: np.ndarray) -> None:
    """Feed a CSR's every entry to hash h (once, when a dataset is written: about 1 s per
    GB). A sample of entries let a graph rewritten in place with other edges at unsampled
    places keep its fingerprint, and with it the old graph's tables and embeddings."""
    h.update(np.int64([indptr.shape[0] - 1, indices.shape[0]]).tobytes())
    h.update(str(indices.dtype).encode())
    for a in (indptr, indices):
        a = a.reshape(-1)
        for lo in range(0, a.shape[0], 1 << 24):  # a memory-mapped array is read a chunk at a time
            h.update(np.ascontiguousarray(a[lo:lo + (1 << 24)]))


def _fingerprint(indptr: np.ndarray, indices: np.ndarray, feature_dim: int) -> str:
    h = hashlib.sha256()
    h.update(np.int64([feature_dim]).tobytes())
    hash_csr(h, indptr, indices)
    return h.hexdigest()[:16]


def write_dataset(
    path: str | Path,
    *,
    indptr: np.ndarray,
    indices: np.ndarray,
    features: np.ndarray | None,
    labels: np.ndarray | None = None,
    masks: dict[str, np.ndarray] | None = None,
    name: str | None = None,
    extra: dict | None = None,
) -> Path:
    """Write a dataset directory. `features=None` means features.npy is already in place
    (generators stream large feature matrices straight to disk)."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / "indptr.npy", np.ascontiguousarray(indptr, dtype=np.int64))
    np.save(root / "indices.npy", np.ascontiguousarray(indices))
    if features is not None:
        np.save(root / "features.npy", np.ascontiguousarray(features, dtype=np.float32))
    feats = np.load(root / "features.npy", mmap_mode="r")
    num_classes = 0
    if labels is not None:
        labels = np.ascontiguousarray(labels, dtype=np.int64)
        np.save(root / "labels.npy", labels)
        num_classes = int(labels.max()) + 1 if labels.size else 0
    for key, mask in (masks or {}).items():
        if key not in MASK_NAMES:
            raise DatasetError(f"unknown mask {key!r}; expected one of {MASK_NAMES}")
        np.save(root / f"{key}.npy", np.ascontiguousarray(mask, dtype=bool))
    meta = {
        "format_version": FORMAT_VERSION,
        "name": name or root.name,
        "num_nodes": int(indptr.shape[0] - 1),
        "num_edges": int(indices.shape[0]),
        "feature_dim": int(feats.shape[1]),
        "num_classes": num_classes,
        "index_dtype": str(indices.dtype),
        "fingerprint": _fingerprint(indptr, indices, int(feats.shape[1])),
        "created_unix_s": time.time(),
    }
    meta.update(extra or {})
    (root / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return root


def read_meta(root: Path) -> dict:
    """A dataset directory's meta.json (either kind); DatasetError naming what is wrong."""
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        if not root.exists() and not root.is_symlink():  # a mistyped path, more often than a directory without one
            raise DatasetError(f"dataset directory {root} does not exist")
        if root.is_file():  # the graph file itself ("graph.pt/meta.json is missing" was the answer)
            raise DatasetError(f"{root} is a file, not a dataset directory: make one from it with "
                               f"`hybridgnn dataset import {root} --out DIR`")
        raise DatasetError(f"{root} is not a hybridgnn dataset: {meta_path} is missing")
    try:
        meta = read_json(meta_path)
    except ValueError as exc:
        raise DatasetError(f"{meta_path} is {exc}") from exc
    if not isinstance(meta, dict):
        raise DatasetError(f"{meta_path} must hold a JSON object")
    return meta


def load_npy(path: Path, missing: str | None):
    """A stored array, memory-mapped (never pickled). missing: the DatasetError message
    when the file is absent (None: absent is allowed, and None is returned)."""
    if not path.is_file():
        if missing is not None:
            raise DatasetError(missing)
        return None
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except OSError as exc:  # unreadable (permissions, an I/O error)
        raise DatasetError(f"{path} cannot be read: {exc}") from exc
    except (ValueError, EOFError) as exc:  # EOFError: an empty file
        with open(path, "rb") as f:
            magic = f.read(6)
        if magic != b"\x93NUMPY":  # numpy calls any such file pickled and advises loading it unsafely
            raise DatasetError(f"{path} is not a readable .npy array: it has no .npy header (damaged or "
                               "overwritten?)") from exc
        raise DatasetError(f"{path} is not a readable .npy array: {exc}") from exc


# Rows (and indices) checked per step by check_csr: bounded temporaries on graphs of
# billions of edges (~50 ms per 100M indices).
_CSR_CHECK_STEP = 1 << 24


def check_csr(indptr: np.ndarray, indices: np.ndarray, num_cols: int, what: str = "") -> None:
    """DatasetError unless indptr never decreases and every index lies in [0, num_cols):
    the compiled samplers and scipy's products read rows without bounds checks, so a
    damaged index array (a flipped bit, a truncated write) would otherwise make them read
    and write outside their arrays (a segmentation fault). Every open checks it: it reads
    each index once, in chunks. indptr's ends are checked by the caller. what: a prefix
    naming the CSR (an edge type's)."""
    step = _CSR_CHECK_STEP
    for lo in range(0, indptr.shape[0] - 1, step):
        seg = np.asarray(indptr[lo:lo + step + 1])
        down = np.flatnonzero(seg[1:] < seg[:-1])
        if down.size:
            row = lo + int(down[0])
            raise DatasetError(f"{what}indptr must be non-decreasing; it falls at row {row} "
                               f"({int(seg[down[0]])} -> {int(seg[down[0] + 1])}): damaged?")
    if not indices.shape[0]:
        return
    low = high = None
    for lo in range(0, indices.shape[0], step):
        seg = np.asarray(indices[lo:lo + step])
        a, b = int(seg.min()), int(seg.max())
        low, high = a if low is None else min(low, a), b if high is None else max(high, b)
    if low < 0 or high >= num_cols:
        raise DatasetError(f"{what}indices must lie in [0, {num_cols}), found [{low}, {high}]")


def check_index_dtypes(indptr: np.ndarray, indices: np.ndarray, what: str = "") -> None:
    """DatasetError unless indptr is a signed integer array and indices an integer one,
    both in this machine's byte order: what the compiled samplers can read (an unsigned
    or byte-swapped indptr failed in the first request's sampling, not at open)."""
    if indptr.dtype.kind != "i" or indices.dtype.kind not in "iu":
        raise DatasetError(f"{what}indptr must be a signed integer array (int64) and indices an integer array, "
                           f"got {indptr.dtype} and {indices.dtype}")
    if not (indptr.dtype.isnative and indices.dtype.isnative):
        raise DatasetError(f"{what}indptr and indices must be stored in this machine's byte order (.npy "
                           f"little-endian), got {indptr.dtype.str} and {indices.dtype.str}")


def float32_features(x: np.ndarray, what: str) -> np.ndarray:
    """x as the float32 rows a dataset stores, or DatasetError naming the first row that
    is not finite there: NaN, an infinity, or a float64 past float32's range (cast to inf
    with only a RuntimeWarning). Every answer that read such a row would be NaN; it was
    imported silently. Checked a block of rows at a time (bounded temporaries)."""
    if x.dtype.kind not in "biuf":
        raise DatasetError(f"{what} must be numbers, got {x.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):
        x = np.asarray(x, dtype=np.float32)
    if x.ndim != 2:
        return x  # the caller names the shape it needs
    step = max(1, (1 << 24) // max(x.shape[1], 1))
    for lo in range(0, x.shape[0], step):
        bad = np.flatnonzero(~np.isfinite(x[lo:lo + step]).all(axis=1))
        if bad.size:
            row = lo + int(bad[0])
            bad_rows = int(bad.size) + sum(int((~np.isfinite(x[i:i + step]).all(axis=1)).sum())
                                           for i in range(lo + step, x.shape[0], step))
            raise DatasetError(f"{what}: row {row} is not finite as float32 (NaN, an infinity, or past float32's "
                               f"range; {bad_rows:,} of {x.shape[0]:,} rows are): every answer reading it would be NaN")
    return x


def check_int64_ids(ei: np.ndarray, src) -> None:
    """DatasetError for unsigned ids past int64's range: ids are stored and requested as
    int64, and the cast wrapped them (18446744073709551615 was stored, and answered, as -1)."""
    if ei.dtype.kind == "u" and ei.size and int(ei.max()) > np.iinfo(np.int64).max:
        raise DatasetError(f"{src}: node id {int(ei.max())} does not fit in int64 (ids are stored and requested as "
                           "int64)")


def dataset_kind(path: str | Path) -> str:
    """'hetero' for a heterogeneous dataset (graph/hetero.py), else 'homogeneous'."""
    try:
        meta = read_meta(Path(path))
    except DatasetError:
        return "homogeneous"  # opening it says what is wrong
    return "hetero" if meta.get("kind") == "hetero" else "homogeneous"


def _load_id_map(root: Path) -> IdMap | None:
    try:
        return IdMap.load(root)
    except ValueError as exc:
        raise DatasetError(f"{root / ID_MAP_FILE} is not a readable id map: {exc}") from exc


@dataclass
class GraphStore:
    """A dataset opened read-only with mmap; one instance is shared by all workers."""

    root: Path
    meta: dict
    indptr: np.ndarray
    indices: np.ndarray
    features: np.ndarray
    labels: np.ndarray | None
    masks: dict[str, np.ndarray]
    id_map: IdMap | None = None  # external node ids (sparse ints or strings), when imported with some

    @classmethod
    def open(cls, path: str | Path, *, validate: str = "quick") -> "GraphStore":
        """Open a dataset directory. validate: 'none', 'quick' (shapes, dtypes, endpoints,
        indptr monotone and every index in range: what sampling needs to stay within the
        arrays) or 'full' (the same)."""
        root = Path(path)
        meta = read_meta(root)
        if meta.get("kind") == "hetero":
            raise DatasetError(f"{root} is a heterogeneous dataset (node types "
                               f"{[t.get('name') for t in meta.get('node_types', [])]}); this needs a "
                               "homogeneous one")

        def load(name: str, required: bool = True):
            return load_npy(root / f"{name}.npy", f"dataset {root} lacks {name}.npy" if required else None)

        store = cls(
            root=root,
            meta=meta,
            indptr=load("indptr"),
            indices=load("indices"),
            features=load("features"),
            labels=load("labels", required=False),
            masks={k: m for k in MASK_NAMES if (m := load(k, required=False)) is not None},
            id_map=_load_id_map(root),
        )
        if validate != "none":
            store.validate(full=(validate == "full"))
        return store

    def validate(self, *, full: bool = False) -> None:
        """Shapes, dtypes, meta.json's counts, and (check_csr) indptr monotone with every
        index in range. full: the same checks (every open reads every index now)."""
        if self.indptr.ndim != 1 or self.indptr.shape[0] < 1:
            raise DatasetError(f"indptr must be 1-D of length num_nodes+1, got shape {self.indptr.shape}")
        n = self.indptr.shape[0] - 1
        check_index_dtypes(self.indptr, self.indices)
        if self.indices.ndim != 1:
            raise DatasetError(f"indices must be 1-D, got shape {self.indices.shape}")
        if n > 0 and (int(self.indptr[0]) != 0 or int(self.indptr[-1]) != self.indices.shape[0]):
            raise DatasetError(
                f"indptr must start at 0 and end at len(indices)={self.indices.shape[0]}, "
                f"got {int(self.indptr[0])}..{int(self.indptr[-1])}"
            )
        if self.features.ndim != 2 or self.features.shape[0] != n:
            raise DatasetError(f"features must be [num_nodes={n}, F], got shape {self.features.shape}")
        if self.features.dtype != np.float32:
            raise DatasetError(f"features must be float32, got {self.features.dtype}")
        if self.labels is not None and (self.labels.shape != (n,) or self.labels.dtype.kind not in "iu"):
            raise DatasetError(f"labels must be integer [num_nodes={n}], got {self.labels.dtype} {self.labels.shape}")
        for key, mask in self.masks.items():
            if mask.shape != (n,) or mask.dtype != bool:
                raise DatasetError(f"{key} must be bool [num_nodes={n}], got {mask.dtype} {mask.shape}")
        for key, expected in (("num_nodes", n), ("num_edges", self.indices.shape[0]), ("num_classes", None)):
            if key not in self.meta:
                continue
            try:
                value = int(self.meta[key])
            except (TypeError, ValueError, OverflowError):
                value = -1
            if value < 0 or value != self.meta[key]:
                raise DatasetError(f"meta.json's {key} must be a whole number >= 0, got {self.meta[key]!r}")
            if expected is not None and value != expected:
                raise DatasetError(f"meta.json says {key}={self.meta[key]} but the arrays hold {expected}")
        if self.id_map is not None and len(self.id_map) != n:
            raise DatasetError(f"{ID_MAP_FILE} names {len(self.id_map)} nodes but the graph has {n}")
        check_csr(self.indptr, self.indices, n)  # quick too: the samplers' memory safety rests on it

    @property
    def num_nodes(self) -> int:
        return int(self.indptr.shape[0] - 1)

    @property
    def num_edges(self) -> int:
        return int(self.indices.shape[0])

    @property
    def feature_dim(self) -> int:
        return int(self.features.shape[1])

    @property
    def num_classes(self) -> int:
        return int(self.meta.get("num_classes", 0))

    @property
    def fingerprint(self) -> str:
        return str(self.meta.get("fingerprint", ""))

    @property
    def name(self) -> str:
        return str(self.meta.get("name", self.root.name))

    def degrees(self) -> np.ndarray:
        return np.diff(self.indptr)

    def describe(self) -> dict:
        deg = self.degrees()
        return {
            "path": str(self.root),
            "name": self.name,
            "num_nodes": self.num_nodes,
            "num_edges": self.num_edges,
            "feature_dim": self.feature_dim,
            "num_classes": self.num_classes,
            "labelled": self.labels is not None,
            "masks": sorted(self.masks),
            "degree_mean": float(deg.mean()) if deg.size else 0.0,
            "degree_max": int(deg.max()) if deg.size else 0,
            "isolated_nodes": int((deg == 0).sum()),
            "fingerprint": self.fingerprint,
        }
