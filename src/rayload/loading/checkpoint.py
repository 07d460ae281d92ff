"""Checkpoint discovery and safetensors header parsing (no tensor data is read).

Layouts (see docs/design.md "Checkpoint layouts"):

* ``hf_single``: one ``model.safetensors``
* ``hf_index``: ``model.safetensors.index.json`` + the shard files it names
* ``converted``: ``rayload-manifest.json`` + ``model-rank-{rank}-part-{part}.safetensors``

Detection, for a directory: an index makes it ``hf_index``, else a manifest makes it
``converted``, else ``model.safetensors`` or the directory's only ``*.safetensors`` file
makes it ``hf_single``. A path to a ``.safetensors`` file is ``hf_single``.

Any layout may sit in object storage (``s3://bucket/prefix``, see
:mod:`~rayload.loading.storage`): the prefix is listed once (each object's size and
version pinned), then the config, index or manifest and every header are read by ranged
GETs, concurrently; no tensor byte is fetched.

Past 400 lines on purpose: the three layouts, local or in object storage, are detected,
read and checked here side by side (they share the header reads and the path checks); the
requests themselves live in :mod:`~rayload.loading.storage`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal, TypeVar

from rayload.errors import CheckpointError
from rayload.loading.header import FileHeader, TensorInfo, read_header
from rayload.loading.manifest import MANIFEST_NAME, Manifest, read_manifest
from rayload.loading.storage import is_remote, storage_for

__all__ = ["Checkpoint", "Layout", "TensorInfo", "open_checkpoint"]

log = logging.getLogger(__name__)

Layout = Literal["hf_single", "hf_index", "converted"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"

_MAX_HEADER_THREADS = 16
T = TypeVar("T")


@dataclass(frozen=True)
class Checkpoint:
    """A validated checkpoint: every header parsed and checked, no tensor data read.

    For the Hugging Face layouts ``tensors`` holds every tensor, in file then offset order.
    For the ``converted`` layout tensor names repeat across ranks: ``tensors`` holds rank
    0's shards and :meth:`rank_tensors` any rank's; ``manifest`` is the parsed
    :class:`~rayload.loading.manifest.Manifest`, ``tp_size`` the tp size it was converted
    for and ``rank_files`` each rank's files.
    """

    root: str
    layout: Layout
    files: tuple[str, ...]
    tensors: Mapping[str, TensorInfo]
    config: Mapping[str, Any] | None
    manifest: Manifest | None = None
    tp_size: int | None = None
    rank_files: Mapping[int, tuple[str, ...]] | None = None
    by_rank: Mapping[int, Mapping[str, TensorInfo]] | None = None
    versions: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    """Object storage: the (size, ETag) at which each object read was seen. A rank handed
    this checkpoint (by the driver, in its load request) reads its byte ranges of those
    versions without reading a header again, or fails naming the object that changed."""

    @property
    def architecture(self) -> str | None:
        archs = (self.config or {}).get("architectures") or []
        return archs[0] if archs else None

    @property
    def total_bytes(self) -> int:
        return sum(storage_for(f).size(f) for f in self.files)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of tensor data in every file (headers excluded)."""
        tables = self.by_rank.values() if self.by_rank is not None else [self.tensors]
        return sum(t.nbytes for table in tables for t in table.values())

    def rank_tensors(self, rank: int) -> Mapping[str, TensorInfo]:
        """The tensors stored for ``rank``: its own shards for the converted layout,
        every tensor otherwise."""
        if self.by_rank is None:
            return self.tensors
        return self.by_rank[rank]


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Find the layout of ``path`` (a directory or a ``.safetensors`` file), parse and
    validate every header, and return the :class:`Checkpoint`.

    Raises :class:`rayload.errors.CheckpointError` naming the file (and tensor) on any of
    the bad inputs listed in docs/design.md (:class:`~rayload.errors.StorageError` when
    object storage refuses or fails).
    """
    if is_remote(os.fspath(path)):
        return _open_remote(os.fspath(path).rstrip("/"))
    given = os.path.abspath(os.fspath(path))
    if os.path.isfile(given):
        if not given.endswith(".safetensors"):
            raise CheckpointError(
                f"{given}: not a .safetensors file; pass the checkpoint directory instead",
                file=given,
            )
        root = os.path.dirname(given)
        return _single(root, given, _read_config(root))
    if not os.path.isdir(given):
        raise CheckpointError(
            f"{given}: no such file or directory; pass a checkpoint directory or a "
            f".safetensors file",
            file=given,
        )
    config = _read_config(given)
    if os.path.isfile(os.path.join(given, INDEX_NAME)):
        return _indexed(given, config)
    if os.path.isfile(os.path.join(given, MANIFEST_NAME)):
        return _converted(given, config)
    return _single(given, _find_single(given), config)


def _open_remote(url: str) -> Checkpoint:
    storage = storage_for(url)
    root = url.rpartition("/")[0] if url.endswith(".safetensors") else url
    storage.adopt(root, {})  # every open reads the objects as they are now
    checkpoint = _open_remote_layout(url, root)
    return replace(checkpoint, versions=storage.versions(root))


def _open_remote_layout(url: str, root: str) -> Checkpoint:
    storage = storage_for(url)
    if url != root:
        storage.size(url)  # StorageError naming bucket, key and endpoint when missing
        return _single(root, url, _read_config(root))
    names = storage.listdir(url)
    if not names:
        raise CheckpointError(
            f"{url}: no objects under this prefix; pass the prefix holding config.json and "
            "the .safetensors files",
            file=url,
        )
    config = _read_config(url)
    if INDEX_NAME in names:
        return _indexed(url, config)
    if MANIFEST_NAME in names:
        return _converted(url, config)
    return _single(url, _find_single(url), config)


def _find_single(root: str) -> str:
    storage = storage_for(root)
    if storage.is_file(storage.join(root, SINGLE_NAME)):
        return storage.join(root, SINGLE_NAME)
    found = [n for n in storage.listdir(root) if n.endswith(".safetensors")]
    if len(found) == 1:
        return storage.join(root, found[0])
    if not found:
        raise CheckpointError(
            f"{root}: no .safetensors file, {INDEX_NAME} or {MANIFEST_NAME}; "
            f"is this a checkpoint directory?",
            file=root,
        )
    raise CheckpointError(
        f"{root}: {len(found)} .safetensors files but no {INDEX_NAME} saying which tensor is "
        f"where; add the index or keep a single model.safetensors",
        file=root,
    )


def _single(root: str, file: str, config: Mapping[str, Any] | None) -> Checkpoint:
    header = read_header(file)
    return Checkpoint(root, "hf_single", (file,), header.tensors, config)


def _indexed(root: str, config: Mapping[str, Any] | None) -> Checkpoint:
    index_path = storage_for(root).join(root, INDEX_NAME)
    weight_map = _read_weight_map(index_path)
    names = sorted(set(weight_map.values()))
    paths = {name: inside_root(root, name, referrer=index_path) for name in names}
    headers = dict(zip(names, read_headers([paths[n] for n in names]), strict=True))
    by_file: dict[str, set[str]] = {name: set() for name in names}
    for tensor, name in weight_map.items():
        by_file[name].add(tensor)
    tensors: dict[str, TensorInfo] = {}
    for name, header in headers.items():
        wanted = by_file[name]
        if missing := sorted(wanted - header.tensors.keys()):
            raise CheckpointError(
                f"{index_path}: weight_map puts tensor {missing[0]!r} in {header.file}, which "
                f"has no such tensor; the index does not match the files: re-download them",
                file=header.file,
                tensor=missing[0],
            )
        if extra := sorted(header.tensors.keys() - wanted):
            log.warning(
                "%s holds %d tensors the index does not list (e.g. %s); they are ignored",
                header.file,
                len(extra),
                extra[0],
            )
        tensors.update((t, info) for t, info in header.tensors.items() if t in wanted)
    return Checkpoint(root, "hf_index", tuple(paths[n] for n in names), tensors, config)


def _converted(root: str, config: Mapping[str, Any] | None) -> Checkpoint:
    storage = storage_for(root)
    manifest_path = storage.join(root, MANIFEST_NAME)
    manifest = read_manifest(manifest_path)
    on_disk = {n for n in storage.listdir(root) if n.endswith(".safetensors")}
    if stray := sorted(on_disk - manifest.files.keys()):
        raise CheckpointError(
            f"{manifest_path}: {storage.join(root, stray[0])} is not listed in the manifest; "
            f"the directory mixes two conversions: re-run `rayload convert` into an empty "
            f"directory",
            file=storage.join(root, stray[0]),
        )
    rank_files: dict[int, tuple[str, ...]] = {}
    for rank in range(manifest.tp_size):
        rank_files[rank] = tuple(
            _checked_rank_file(root, name, manifest, manifest_path) for name in manifest.ranks[rank]
        )
    files = tuple(f for rank in range(manifest.tp_size) for f in rank_files[rank])
    headers = dict(zip(files, read_headers(list(files)), strict=True))
    by_rank = {
        rank: _rank_tensors(rank, [headers[f] for f in paths], manifest, manifest_path)
        for rank, paths in rank_files.items()
    }
    return Checkpoint(
        root,
        "converted",
        files,
        by_rank[0],
        config,
        manifest=manifest,
        tp_size=manifest.tp_size,
        rank_files=rank_files,
        by_rank=by_rank,
    )


def _checked_rank_file(root: str, name: str, manifest: Manifest, manifest_path: str) -> str:
    path = inside_root(root, name, referrer=manifest_path)
    size, expected = storage_for(path).size(path), manifest.files[name].size
    if size != expected:
        raise CheckpointError(
            f"{path}: is {size} bytes but {manifest_path} says {expected}; the file is "
            f"truncated or was rewritten: re-run `rayload convert`",
            file=path,
        )
    return path


def _rank_tensors(
    rank: int, headers: list[FileHeader], manifest: Manifest, manifest_path: str
) -> dict[str, TensorInfo]:
    """Rank ``rank``'s tensors across its files, checked against the manifest: each one
    listed there, once, on the rank that owns it (the planner checks their shapes)."""
    tensors: dict[str, TensorInfo] = {}
    for header in headers:
        for name, info in header.tensors.items():
            if name in tensors:
                raise CheckpointError(
                    f"{info.file}: tensor {name!r} of rank {rank} is also in "
                    f"{tensors[name].file}; re-run `rayload convert`",
                    file=info.file,
                    tensor=name,
                )
            if name not in manifest.splits:
                raise CheckpointError(
                    f"{info.file}: tensor {name!r} is not in {manifest_path}; "
                    f"re-run `rayload convert`",
                    file=info.file,
                    tensor=name,
                )
            owner = (manifest.owners or {}).get(name, rank)
            if owner != rank:
                raise CheckpointError(
                    f"{info.file}: tensor {name!r} belongs to rank {owner} (expert parallel), "
                    f"not to rank {rank}; re-run `rayload convert`",
                    file=info.file,
                    tensor=name,
                )
            tensors[name] = info
    if missing := sorted(manifest.rank_names(rank) - tensors.keys()):
        raise CheckpointError(
            f"{manifest_path}: rank {rank}'s files {[h.file for h in headers]} lack tensor "
            f"{missing[0]!r} (and {len(missing) - 1} more); re-run `rayload convert`",
            file=manifest_path,
            tensor=missing[0],
        )
    return tensors


def _read_weight_map(index_path: str) -> dict[str, str]:
    data = read_json(index_path, what="index")
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items()
    ):
        raise CheckpointError(
            f"{index_path}: has no 'weight_map' object mapping tensor names to file names; "
            f"re-download the index",
            file=index_path,
        )
    if not weight_map:
        raise CheckpointError(
            f"{index_path}: 'weight_map' is empty; re-download the index", file=index_path
        )
    return weight_map


def inside_root(root: str, name: str, *, referrer: str) -> str:
    """The absolute path of file ``name`` listed in ``referrer``, checked to exist and to
    stay inside ``root`` once symlinks are resolved (in object storage: a plain name,
    no ``..``, listed under the prefix)."""
    if is_remote(root):
        return _inside_remote(root, name, referrer=referrer)
    candidate = os.path.join(root, name)
    real_root = os.path.realpath(root)
    real = os.path.realpath(candidate)
    if os.path.isabs(name) or os.path.commonpath([real_root, real]) != real_root:
        raise CheckpointError(
            f"{referrer}: names file {candidate} (resolving to {real}), which is outside "
            f"the checkpoint directory {root}; refusing to read it: list only files inside "
            f"the directory",
            file=candidate,
        )
    if not os.path.isfile(real):
        raise CheckpointError(
            f"{referrer}: names file {candidate}, which does not exist; the download is "
            f"incomplete: fetch the missing file",
            file=candidate,
        )
    return os.path.abspath(candidate)


def _inside_remote(root: str, name: str, *, referrer: str) -> str:
    storage = storage_for(root)
    candidate = storage.join(root, name)
    if name.startswith("/") or ".." in name.split("/") or "" in name.split("/"):
        raise CheckpointError(
            f"{referrer}: names file {name!r}, which is not a plain name inside the "
            f"checkpoint prefix {root}; refusing to read it: list only objects under it",
            file=candidate,
        )
    if not storage.is_file(candidate):
        raise CheckpointError(
            f"{referrer}: names file {candidate}, which does not exist; the upload is "
            f"incomplete: upload the missing file",
            file=candidate,
        )
    return candidate


def read_headers(paths: list[str]) -> list[FileHeader]:
    """Headers of ``paths``, in order; read in parallel (see :func:`per_file`)."""
    return per_file(read_header, paths)


def per_file(read: Callable[[str], T], paths: Sequence[str]) -> list[T]:
    """``read(path)`` of each of ``paths``, in order, up to 16 at once: object storage and
    network filesystems pay a round trip per request, so a checkpoint's files are read
    side by side. The first error is raised in path order."""
    if len(paths) <= 1:
        return [read(p) for p in paths]
    with ThreadPoolExecutor(min(_MAX_HEADER_THREADS, len(paths))) as pool:
        return list(pool.map(read, paths))


def read_json(path: str, *, what: str) -> Any:
    """The JSON document at ``path``; CheckpointError naming it and ``what`` it is."""
    try:
        return json.loads(storage_for(path).read_all(path))
    except OSError as exc:
        raise CheckpointError(
            f"{path}: cannot read the {what} ({exc.strerror})", file=path
        ) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: the {what} is not valid JSON ({exc}); re-download or fix it", file=path
        ) from exc
    except RecursionError as exc:
        raise CheckpointError(
            f"{path}: the {what} is JSON nested too deeply to parse; re-download or fix it",
            file=path,
        ) from exc


def _read_config(root: str) -> Mapping[str, Any] | None:
    storage = storage_for(root)
    path = storage.join(root, CONFIG_NAME)
    if not storage.is_file(path):
        return None
    config = read_json(path, what="model config")
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{path}: the model config is a JSON {type(config).__name__}, not an object; "
            f'fix it to {{"architectures": ["...ForCausalLM"], ...}} or remove it',
            file=path,
        )
    architectures = config.get("architectures")
    if architectures is not None and not (
        isinstance(architectures, list) and all(isinstance(a, str) for a in architectures)
    ):
        raise CheckpointError(
            f"{path}: 'architectures' is {architectures!r}, not a list of class names; "
            f'fix it to e.g. ["LlamaForCausalLM"] (the sharding preset is chosen from it)',
            file=path,
        )
    return config
