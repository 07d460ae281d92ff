"""What makes two ranks' shards the same bytes, whatever their paths: the key under
which a replica offers its shards to others (the ``peer`` method).

Two loads may share shards exactly when they load the same checkpoint content with the
same plan. Paths say nothing about content (a copy elsewhere is the same checkpoint; a
checkpoint rewritten in place is not), so :func:`checkpoint_identity` hashes what the
files hold, cheaply: headers and a sample of the data, never all of it.

* Hugging Face layouts: each file's path in the checkpoint, size and the SHA-256 of its
  header bytes (the 8-byte length and the JSON header, which hold every tensor's name,
  dtype, shape and offsets, and the metadata) and of :data:`SAMPLES` data blocks spread
  over the file. The header alone is not enough: a fine-tuned model, or the next step of
  an RL run, is saved with the same header and sizes as its base. Two checkpoints that
  differ only between the sampled blocks (e.g. a few tensors edited in place) would still
  share a key: for those, ``rayload convert`` them (whole-file CRC-32s) or load with
  ``peers=False``.
* The same layouts in object storage (``s3://``): each object's path in the checkpoint,
  size and ETag as the checkpoint was opened (``Checkpoint.versions``), without a
  request. A new write of an object gives it a new ETag; a copy keeps it where the store
  derives ETags from the content (an MD5, or the MD5s of the same parts: copies uploaded
  alike, server-side copies), and otherwise gets another key (no sharing, never wrong
  sharing). An ``s3://`` checkpoint and a local copy of it have different keys.
* Converted layout: the manifest's tp size and each file's size and CRC-32 (which
  ``rayload convert`` computed over the whole file, data included).

:func:`plan_identity` hashes the plan (tp size, expert parallel, every rank's shards);
:func:`peer_key` joins both into one short key, ``ckpt-<12 hex>.plan-<12 hex>``.
"""

from __future__ import annotations

import hashlib
import json
import os

from rayload.errors import CheckpointError
from rayload.loading.checkpoint import Checkpoint, per_file
from rayload.loading.plan import ShardPlan
from rayload.loading.storage import is_remote

SAMPLES = 16
SAMPLE_BYTES = 4096
"""Data blocks hashed per file beside its header: a fine-tuned checkpoint (or the next
step of an RL run) has the same header and sizes as the one it came from, and differs in
every block; 64 KiB of reads per file tell them apart."""

_DIGITS = 12
"""Hex digits of each half of a peer key (48 bits each: collisions are not a concern for
the handful of checkpoints a cluster holds)."""


def checkpoint_identity(checkpoint: Checkpoint) -> str:
    """The SHA-256 (hex) of the checkpoint's content as its headers and sampled data (or,
    converted, its manifest) describe it; the same for a copy at another path. Reads
    each file's header and :data:`SAMPLES` blocks of :data:`SAMPLE_BYTES`, the files side
    by side; CheckpointError naming the file when one cannot be read. In object storage
    it reads nothing: each object's size and ETag, as the checkpoint was opened, stand
    for its content (18 GETs per file, one after the other, took 20 s of a load of 24
    files against the tests' server)."""
    if checkpoint.layout == "converted":
        manifest = checkpoint.manifest
        assert manifest is not None, "a converted checkpoint has its manifest"
        entries = {
            name: {"size": entry.size, "crc32": entry.crc32}
            for name, entry in sorted(manifest.files.items())
        }
        return _sha256({"layout": "converted", "tp_size": manifest.tp_size, "files": entries})
    if is_remote(checkpoint.root):  # the store's own version of each object: no request
        files = {
            _relative(checkpoint.root, path): dict(
                zip(("size", "etag"), checkpoint.versions[path], strict=True)
            )
            for path in checkpoint.files
        }
        return _sha256({"layout": "hf-object-store", "files": dict(sorted(files.items()))})
    digests = per_file(_file_sha256, checkpoint.files)
    files = {
        _relative(checkpoint.root, path): {"size": os.path.getsize(path), "sha256": sha}
        for path, sha in zip(checkpoint.files, digests, strict=True)
    }
    return _sha256({"layout": "hf", "files": dict(sorted(files.items()))})


def plan_identity(plan: ShardPlan) -> str:
    """The SHA-256 (hex) of the plan: tp size, expert parallel and every rank's shards
    (name, dtype, full and shard shape, split, pieces), in order. File paths and offsets
    are left out: they follow from the checkpoint, not the plan."""
    ranks = [
        [
            [
                s.name,
                s.dtype,
                list(s.full_shape),
                list(s.shape),
                s.split,
                [list(p) for p in s.pieces],
            ]
            for s in rank.shards
        ]
        for rank in plan.ranks
    ]
    return _sha256(
        {"tp_size": plan.tp_size, "expert_parallel": plan.expert_parallel, "ranks": ranks}
    )


def peer_key(checkpoint: Checkpoint, plan: ShardPlan) -> str:
    """``ckpt-<12 hex>.plan-<12 hex>``: ranks with the same key hold the same shard bytes."""
    return f"ckpt-{checkpoint_identity(checkpoint)[:_DIGITS]}.plan-{plan_identity(plan)[:_DIGITS]}"


def _sha256(value: object) -> str:
    """SHA-256 (hex) of ``value`` as canonical JSON."""
    return hashlib.sha256(
        json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def _relative(root: str, path: str) -> str:
    if is_remote(path):
        return path[len(root) :].lstrip("/")
    return os.path.relpath(path, root).replace(os.sep, "/")


def _file_sha256(path: str) -> str:
    """SHA-256 of the 8-byte header length, the JSON header of ``path`` and
    :data:`SAMPLES` blocks of its data, evenly spaced from the first byte after the header
    to the last."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as file:  # unbuffered: no read-ahead
            prefix = file.read(8)
            header = file.read(int.from_bytes(prefix, "little")) if len(prefix) == 8 else b""
            digest.update(prefix + header)
            start, size = 8 + len(header), os.fstat(file.fileno()).st_size
            for offset in _sample_offsets(start, size):
                digest.update(os.pread(file.fileno(), SAMPLE_BYTES, offset))
    except OSError as exc:
        raise CheckpointError(
            f"{path}: cannot read its header ({exc.strerror or exc}); check that the "
            "checkpoint is still there and readable",
            file=path,
        ) from exc
    return digest.hexdigest()


def _sample_offsets(start: int, end: int) -> list[int]:
    """Where the sampled blocks of a data region ``[start, end)`` begin (all of it when it
    is smaller than the samples together)."""
    span = end - start
    if span <= SAMPLES * SAMPLE_BYTES:
        return list(range(start, end, SAMPLE_BYTES))
    step = (span - SAMPLE_BYTES) / (SAMPLES - 1)
    return [start + round(i * step) for i in range(SAMPLES)]
