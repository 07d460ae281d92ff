"""Checkpoints shared by every test package.

* ``tiny_llama``: a synthetic Llama (bf16, real HF names, index over 2 files), written by
  rayload's own writer. Session-scoped: do not modify it, copy it first.
* ``mixed_dtype_checkpoint``: Llama names in BF16, F16, F32 and I32 (split-0, split-1 and
  replicated tensors in each), index over 3 files + config.json, written by the
  ``safetensors`` library so it is the reference format. Session-scoped, read-only.
* ``reference_shard(path, rank, tp, name, split)``: what rank ``rank`` of ``tp`` must
  hold of ``name``, sliced from ``safetensors.torch.load_file`` (for these unfused Llama
  names; a ``k_proj``/``v_proj`` with fewer KV heads than ranks is one whole KV head,
  ``rank // (tp // kv_heads)``: vLLM's replication).
* ``reference(family)``: a tiny checkpoint written by ``transformers`` with its reference
  logits (the oracle of the TP forward tests). Session-scoped.
* ``write_raw_safetensors(path, header, data)``: write a possibly malformed file byte by
  byte (8-byte length, JSON header, data), for bad-input tests.
* ``fresh_demo``: one ``python -m rayload.cli demo`` in a fresh process (no ``RAY_*`` in
  its environment, so it starts and stops its own Ray) and the trace it wrote. Session-
  scoped: its exit, stderr and trace are read by tests/ray_cluster/test_cli_load.py and
  tests/tracing/test_demo_trace.py; one run instead of one each (~20 s), in the background.
* ``background_runs``: the slow self-contained child processes (``BACKGROUND_RUNS``: the
  demo, the four-node cluster, ``ray job submit``, the peer and start-up benchmarks' quick
  runs, the benchmark harness's runs behind ``bench_result`` and ``moe_result``) started
  at the session's start and run one after the other while the suite goes on
  (tests/support/background.py). A run starts only if a selected test uses the fixture it
  is named after, and those tests run last.

The fast loop (``make test-fast`` = ``pytest --fast``) deselects the tests marked ``slow``,
``ray`` (every test under tests/ray_cluster is marked here) and ``browser``, and keeps the
selection honest: it points ``RAY_TMPDIR`` at an empty directory, and a test after which
anything appeared there (Ray started, in this process or in a child) fails, naming the
marker it needs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from rayload.loading.synthetic import write_checkpoint
from support.background import BackgroundRuns, Run
from support.cli import FreshDemo
from support.s3 import s3_environment

# The standard AWS environment naming the tests' S3 server (tests/support/s3.py), set before
# any Ray cluster starts: rank actors inherit it as their node's environment.
os.environ.update(s3_environment())

MIXED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.int32)
FAST_SKIPS = ("slow", "ray", "browser")
"""The markers ``--fast`` deselects."""
_TESTS = Path(__file__).parent
_RAY_PACKAGE = _TESTS / "ray_cluster"
_FAST_RAY_DIR = pytest.StashKey[str]()
_BACKGROUND = pytest.StashKey[BackgroundRuns]()
_KEEP_RAY_TMPDIR = ("RAY_TMPDIR",)

BACKGROUND_RUNS = {
    "fresh_demo": Run(lambda _: [sys.executable, "-m", "rayload.cli", "demo"]),
    "quick_run": Run(
        lambda d: [
            *(sys.executable, "-m", "rayload.cli", "bench", "--replicas", "1", "2", "--quick"),
            *("--out", str(d / "out"), "--workdir", str(d / "work")),
        ],
        keep_env=_KEEP_RAY_TMPDIR,
    ),
    "bench_result": Run(
        lambda d: [sys.executable, str(_TESTS / "benchmark" / "bench_script.py"), str(d), "llama"]
    ),
    "moe_result": Run(
        lambda d: [sys.executable, str(_TESTS / "benchmark" / "bench_script.py"), str(d), "moe"]
    ),
    "startup_result": Run(
        lambda d: [sys.executable, str(_TESTS / "benchmark" / "startup_script.py"), str(d)],
        keep_env=_KEEP_RAY_TMPDIR,
    ),
    "job_submit_run": Run(
        lambda d: [sys.executable, str(_RAY_PACKAGE / "job_submit_script.py"), str(d)]
    ),
    "multinode": Run(
        lambda _: [sys.executable, str(_RAY_PACKAGE / "multinode_script.py")],
        keep_env=_KEEP_RAY_TMPDIR,
    ),
}
"""The background runs, each named after the fixture that reads it (its tests: where that
fixture is defined)."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fast",
        action="store_true",
        help="the everyday loop: no test marked slow, ray or browser; fails a test that "
        "starts Ray anyway",
    )


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--fast"):
        # Short (Ray's socket paths must stay under 108 bytes) and empty: see _no_ray_in_fast.
        ray_dir = tempfile.mkdtemp(prefix="rl-fast-")
        config.stash[_FAST_RAY_DIR] = ray_dir
        os.environ["RAY_TMPDIR"] = ray_dir
    config.stash[_BACKGROUND] = BackgroundRuns(BACKGROUND_RUNS, os.environ)


def pytest_unconfigure(config: pytest.Config) -> None:
    background = config.stash.get(_BACKGROUND, None)
    if background is not None:
        background.stop()
    ray_dir = config.stash.get(_FAST_RAY_DIR, None)
    if ray_dir is not None:
        shutil.rmtree(ray_dir, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(_RAY_PACKAGE):
            item.add_marker(pytest.mark.ray)
    if config.getoption("--fast"):
        keep = [i for i in items if not any(i.get_closest_marker(m) for m in FAST_SKIPS)]
        config.hook.pytest_deselected(items=[i for i in items if i not in keep])
        items[:] = keep
    # Tests reading a background run go last, in their order: the runs overlap the rest.
    waiting = [i for i in items if set(BACKGROUND_RUNS) & set(getattr(i, "fixturenames", ()))]
    moved = set(waiting)
    items[:] = [i for i in items if i not in moved] + waiting


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session: pytest.Session) -> None:
    """Start the background runs the selected tests read, in the order they are read."""
    if session.config.option.collectonly:
        return
    needed: list[str] = []
    for item in session.items:
        for name in getattr(item, "fixturenames", ()):
            if name in BACKGROUND_RUNS and name not in needed:
                needed.append(name)
    session.config.stash[_BACKGROUND].start(needed)


@pytest.fixture(scope="session")
def background_runs(pytestconfig: pytest.Config) -> BackgroundRuns:
    return pytestconfig.stash[_BACKGROUND]


@pytest.fixture(autouse=True)
def _no_ray_in_fast(request: pytest.FixtureRequest) -> Iterator[None]:
    """Under ``--fast``: fail the test after which Ray left anything in ``RAY_TMPDIR``."""
    ray_dir = request.config.stash.get(_FAST_RAY_DIR, None)
    yield
    if ray_dir is not None and os.listdir(ray_dir):
        shutil.rmtree(ray_dir, ignore_errors=True)
        os.makedirs(ray_dir)
        pytest.fail(
            "this test started Ray, which `make test-fast` runs without: mark it "
            "@pytest.mark.ray (or slow)",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama") / "ckpt", seed=1234)


def _values(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=gen, dtype=dtype)


@pytest.fixture(scope="session")
def mixed_dtype_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 Llama layers, layer i stored in MIXED_DTYPES[i]; tp 1, 2, 4 and 8 all divide."""
    root = tmp_path_factory.mktemp("mixed-dtype") / "ckpt"
    root.mkdir()
    gen = torch.Generator().manual_seed(7)
    vocab, hidden, inter, heads, kv_heads = 256, 64, 128, 8, 4
    kv_rows = kv_heads * hidden // heads
    files: list[dict[str, torch.Tensor]] = [{}, {}, {}]
    files[0]["model.embed_tokens.weight"] = _values((vocab, hidden), torch.bfloat16, gen)
    for layer, dtype in enumerate(MIXED_DTYPES):
        p = f"model.layers.{layer}."
        part = files[layer // 2]
        for name, shape in [
            ("self_attn.q_proj.weight", (hidden, hidden)),
            ("self_attn.k_proj.weight", (kv_rows, hidden)),
            ("self_attn.v_proj.weight", (kv_rows, hidden)),
            ("self_attn.o_proj.weight", (hidden, hidden)),
            ("mlp.gate_proj.weight", (inter, hidden)),
            ("mlp.up_proj.weight", (inter, hidden)),
            ("mlp.down_proj.weight", (hidden, inter)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        ]:
            part[p + name] = _values(shape, dtype, gen)
    files[2]["model.norm.weight"] = _values((hidden,), torch.float32, gen)
    files[2]["lm_head.weight"] = _values((vocab, hidden), torch.float16, gen)
    weight_map = {}
    for number, tensors in enumerate(files, start=1):
        name = f"model-{number:05d}-of-00003.safetensors"
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": len(MIXED_DTYPES),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "tie_word_embeddings": False,
    }
    (root / "config.json").write_text(json.dumps(config))
    return root


def _all_tensors(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file)))
    return tensors


def _kv_heads(path: Path) -> int | None:
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("num_key_value_heads") or data.get("num_attention_heads")


@pytest.fixture(scope="session")
def reference_shard() -> Callable[[Path, int, int, str, int | None], torch.Tensor]:
    """``(path, rank, tp, name, split) -> tensor``: the expected shard, contiguous."""
    cache: dict[Path, dict[str, torch.Tensor]] = {}

    def shard(path: Path, rank: int, tp: int, name: str, split: int | None) -> torch.Tensor:
        key = Path(path).resolve()
        if key not in cache:
            cache[key] = _all_tensors(key)
        full = cache[key][name]
        if split is None:
            return full
        kv_heads = _kv_heads(key)
        if kv_heads and kv_heads < tp and re.search(r"\.[kv]_proj\.", name):
            head = rank // (tp // kv_heads)
            return torch.tensor_split(full, kv_heads, dim=split)[head].contiguous()
        return torch.tensor_split(full, tp, dim=split)[rank].contiguous()

    return shard


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Any]:
    """``reference(family) -> Reference``: the family's tiny transformers checkpoint, input
    ids and transformers' own logits (``support.transformers_models``), made on first use
    and shared by the session's forward-pass tests."""
    pytest.importorskip("transformers")
    from support.transformers_models import write_reference

    root = tmp_path_factory.mktemp("hf-reference")
    cache: dict[str, Any] = {}

    def get(family: str) -> Any:
        if family not in cache:
            cache[family] = write_reference(family, root / family)
        return cache[family]

    return get


@pytest.fixture
def write_raw_safetensors() -> Callable[..., Path]:
    """``(path, header, data=b"", *, length=None) -> path``: ``header`` (a dict, or bytes
    written verbatim) after an 8-byte little-endian length (``length`` overrides it)."""

    def write(path: Path, header: Any, data: bytes = b"", *, length: int | None = None) -> Path:
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        size = len(raw) if length is None else length
        Path(path).write_bytes(size.to_bytes(8, "little") + raw + data)
        return Path(path)

    return write


@pytest.fixture(scope="session")
def make_converted() -> Callable[[Path, Path, int], Path]:
    """``(src, out, tp) -> out``: a converted checkpoint of ``src`` for ``tp``, built by
    hand (safetensors library + manifest) so tests do not depend on ``rayload convert``."""
    from rayload.loading.manifest import Manifest, file_entry, rank_file_name, write_manifest
    from rayload.loading.plan import plan_shards
    from rayload.loading.rules import resolve_rules

    def make(src: Path, out: Path, tp: int) -> Path:
        plan = plan_shards(src, tp)
        tensors = _all_tensors(src)
        out.mkdir(parents=True)
        ranks, files = {}, {}
        for rank in range(tp):
            shards = {
                name: tensors[name]
                if split is None
                else torch.tensor_split(tensors[name], tp, dim=split)[rank].contiguous()
                for name, split in plan.splits.items()
            }
            name = rank_file_name(rank, 0)
            save_file(shards, str(out / name))
            ranks[rank] = [name]
            files[name] = file_entry(out / name)
        config = json.loads((src / "config.json").read_text())
        manifest = Manifest(
            format_version=1,
            tp_size=tp,
            architecture=config["architectures"][0],
            rules=[r.to_spec() for r in resolve_rules(None, config["architectures"][0]).rules],
            ranks=ranks,
            files=files,
            splits=dict(plan.splits),
            full_shapes={n: list(t.shape) for n, t in tensors.items()},
        )
        write_manifest(manifest, out)
        (out / "config.json").write_text(json.dumps(config))
        return out

    return make


@pytest.fixture(scope="session")
def fresh_demo(background_runs: BackgroundRuns) -> FreshDemo:
    """``rayload demo`` (its default trace directory) from a fresh process: a process of
    its own because the demo must start and stop its own Ray, whatever this one runs."""
    done = background_runs.result("fresh_demo")
    return FreshDemo(run=done.run, trace_dir=done.workdir / "rayload-demo-traces")
