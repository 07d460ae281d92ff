"""Slow self-contained runs started when the session starts, so that their wall time
overlaps the rest of the suite instead of adding to it.

Each run is one child interpreter that needs nothing from the test process (its own Ray
cluster, its own checkpoint, its own temp directory) and prints (or writes) what its tests
check: the four-node cluster of tests/ray_cluster/test_multinode.py, ``ray job submit``
against a ``ray start`` head of its own, the peer benchmark's quick mode, the start-up
benchmark, the benchmark harness's runs (tests/benchmark/bench_script.py), ``rayload demo``
from a fresh process. A run is named after the fixture that reads it; it starts only when
a selected test uses that fixture, and those tests move to the end of the session
(tests/conftest.py) so the runs have the rest of the suite to finish in. pytest itself
keeps about one core busy; the runs go one at a time, in the order their tests come, on
what is left (two at once on 2 cores would slow each other and every Ray test beside
them).

The children get the environment the session started with, never a test's monkeypatched
variables (``RAYLOAD_TEST_HOOKS`` of a fault test running at that moment), minus ``RAY_*``
unless a run keeps some: none of them is this session's Ray.
"""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

RUN_TIMEOUT_S = 600
"""A run that takes longer is killed (its fixture then fails with what it printed)."""


@dataclass(frozen=True)
class Run:
    """``argv(workdir)``: the command, given an empty directory of its own that lives until
    the session ends; ``keep_env``: the ``RAY_*`` variables it inherits."""

    argv: Callable[[Path], Sequence[str]]
    keep_env: tuple[str, ...] = ()


@dataclass
class _Started:
    workdir: Path
    done: threading.Event = field(default_factory=threading.Event)
    result: subprocess.CompletedProcess[str] | None = None
    process: subprocess.Popen[str] | None = None


@dataclass(frozen=True)
class Finished:
    """What a run printed, its exit code, and its directory (for the files it wrote)."""

    run: subprocess.CompletedProcess[str]
    workdir: Path


class BackgroundRuns:
    """Runs ``names`` of ``runs`` one after the other on a thread of this process (which
    only waits on the children), from :meth:`start` on."""

    def __init__(self, runs: Mapping[str, Run], env: Mapping[str, str]) -> None:
        self._runs = dict(runs)
        self._env = dict(env)
        self._root = Path(tempfile.mkdtemp(prefix="rayload-bg-"))
        self._started: dict[str, _Started] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self, names: Sequence[str]) -> None:
        """Queue ``names`` (in this order) and start the first."""
        queue = [(name, self._claim(name)) for name in names]
        self._thread = threading.Thread(
            target=self._run_all, args=(queue,), name="rayload-background-runs", daemon=True
        )
        self._thread.start()

    def result(self, name: str) -> Finished:
        """The finished run ``name``, waiting for it; a run nobody queued runs now."""
        with self._lock:
            started = self._started.get(name)
        if started is None:
            started = self._claim(name)
            self._run_one(name, started)
        started.done.wait()
        assert started.result is not None
        return Finished(run=started.result, workdir=started.workdir)

    def stop(self) -> None:
        """Kill what still runs (its process group: the child's Ray too) and forget it all."""
        with self._lock:
            self._stopping = True
            running = [s.process for s in self._started.values() if s.process is not None]
        for process in running:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
        if self._thread is not None:
            self._thread.join(timeout=30)
        subprocess.run(["rm", "-rf", str(self._root)], check=False)

    def _claim(self, name: str) -> _Started:
        with self._lock:
            workdir = self._root / name
            workdir.mkdir()
            started = self._started[name] = _Started(workdir=workdir)
            return started

    def _run_all(self, queue: list[tuple[str, _Started]]) -> None:
        for name, started in queue:
            self._run_one(name, started)

    def _run_one(self, name: str, started: _Started) -> None:
        run = self._runs[name]
        env = {k: v for k, v in self._env.items() if not k.startswith("RAY") or k in run.keep_env}
        argv = list(run.argv(started.workdir))
        try:
            with self._lock:
                if self._stopping:
                    started.result = subprocess.CompletedProcess(argv, -1, "", "session ended")
                    return
                started.process = subprocess.Popen(
                    argv,
                    cwd=started.workdir,
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,  # stop() kills its whole group
                )
            try:
                out, err = started.process.communicate(timeout=RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(started.process.pid, signal.SIGKILL)
                out, err = started.process.communicate()
                err += f"\nkilled after {RUN_TIMEOUT_S} s"
            started.result = subprocess.CompletedProcess(argv, started.process.returncode, out, err)
        finally:
            started.done.set()
