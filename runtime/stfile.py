"""A checkpoint file opened once: verified against its manifest record, then read in slices.

A safetensors file (https://huggingface.co/docs/safetensors: an 8-byte little-endian header
length N, N bytes of JSON header ``{key: {dtype, shape, data_offsets}, "__metadata__": {...}}``,
then the tensor bytes) is mapped from one descriptor opened without following links
(`plans.io.open_regular`); its SHA-256 is computed over that mapping and the tensors are read
from it, so the bytes that were verified are the bytes that are used (reopening the path, as
``safetensors.safe_open`` would, could read a file swapped in after the check). Pages are read
on demand; a rank reads only the slices it needs after hashing.

Every way the file can be damaged (size, hash, header, a missing key, a shape its box does not
match) is a `Damaged` error naming the file, which ``--resume auto`` answers by falling back to
an older checkpoint.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import mmap
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from plans.errors import PlannerError
from plans.io import open_regular

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
HEADER_MAX_BYTES = 100 * 2**20  # safetensors' own limit


class Damaged(PlannerError):
    """A checkpoint file that is not what its manifest records (an older checkpoint may be intact)."""


class CheckpointFile:
    """One verified safetensors file of a checkpoint."""

    def __init__(self, path: Path, *, size: int, sha256: str) -> None:
        self.path = path
        where = f"checkpoint file {str(path)!r}"
        try:
            fd = open_regular(path)
        except OSError as e:
            why = "it is a symbolic link, which planner never follows in a checkpoint" if e.errno == errno.ELOOP \
                else (e.strerror or str(e))
            raise Damaged(f"cannot open {where}: {why}") from None
        try:
            actual = os.fstat(fd).st_size
            if actual != size:
                raise Damaged(f"{where} has {actual} bytes, its manifest records {size}")
            # A private (copy-on-write) mapping: tensors may view it writably; the file is never changed.
            self.buf = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) if size else b""
        finally:
            os.close(fd)
        if hashlib.sha256(self.buf).hexdigest() != sha256:
            raise Damaged(f"{where} does not have the content its manifest records (SHA-256 differs): it was damaged "
                          "after it was written")
        self.entries, self.meta = self._header(where)

    def _header(self, where: str) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], int, int]], dict[str, str]]:
        buf = self.buf
        if len(buf) < 8:
            raise Damaged(f"{where} is not a safetensors file: {len(buf)} bytes")
        n = int.from_bytes(buf[:8], "little")
        if not 0 < n <= min(HEADER_MAX_BYTES, len(buf) - 8):
            raise Damaged(f"{where} is not a safetensors file: header length {n} of a {len(buf)}-byte file")
        try:
            header = json.loads(bytes(buf[8:8 + n]))
        except (ValueError, RecursionError) as e:
            raise Damaged(f"{where} has an unreadable safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise Damaged(f"{where} has a safetensors header that is not a JSON object")
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
            raise Damaged(f"{where} has safetensors metadata that is not a map of strings")
        data = len(buf) - 8 - n
        entries = {}
        for key, info in header.items():
            try:
                dtype, shape, (lo, hi) = DTYPES[info["dtype"]], tuple(int(d) for d in info["shape"]), info["data_offsets"]
                ok = all(d >= 0 for d in shape) and isinstance(lo, int) and isinstance(hi, int) and 0 <= lo <= hi <= data
                ok = ok and hi - lo == math.prod(shape) * dtype.itemsize
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise Damaged(f"{where}: tensor {key!r} has a malformed header entry {str(info)[:200]}")
            entries[key] = (dtype, shape, 8 + n + lo, 8 + n + hi)
        return entries, meta

    def tensor(self, key: str, *, shape: tuple[int, ...] | None = None) -> Tensor:
        """The tensor `key` (a view of the mapping; copy what you keep), checked against `shape`."""
        if key not in self.entries:
            raise Damaged(f"checkpoint file {str(self.path)!r} has no tensor {key!r}, which its manifest lists")
        dtype, have, lo, hi = self.entries[key]
        if shape is not None and tuple(shape) != have:
            raise Damaged(f"checkpoint file {str(self.path)!r}: tensor {key!r} has shape {have}, its manifest box "
                          f"says {tuple(shape)}")
        if hi == lo:
            return torch.empty(have, dtype=dtype)
        return torch.frombuffer(self.buf, dtype=dtype, count=(hi - lo) // dtype.itemsize, offset=lo).view(have)

    def metadata_json(self, key: str) -> Any:
        """A JSON value stored in the file's safetensors metadata under `key`."""
        where = f"checkpoint file {str(self.path)!r}"
        if key not in self.meta:
            raise Damaged(f"{where} lacks the metadata {key!r}")
        try:
            return json.loads(self.meta[key])
        except (ValueError, RecursionError) as e:
            raise Damaged(f"{where}: metadata {key!r} is not valid JSON: {e}") from None
