"""When the cluster itself fails, ``rayload load`` ends with one line, fast, and leaves
nothing behind: an address that does not answer (however it was found), a head lost while
the ranks start, a driver waiting on a hung rank (it must not spin) and a driver killed
mid-load. Each runs the CLI in a subprocess against its own ``ray start --head`` (loopback,
free ports, its own ``--temp-dir``, ``RAY_AUTH_MODE=disabled`` for it and its clients),
stopped by killing that temp dir's processes, never with ``ray stop``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ray_cluster.job_submit_script import free_ports, processes_using
from rayload.loading import write_checkpoint

RAY = str(Path(sys.executable).with_name("ray"))
RAYLOAD = str(Path(sys.executable).with_name("rayload"))
HANG_ON_READ = {"fault": {"rank": 1, "phase": "rank.read", "action": "hang", "seconds": 600}}

pytestmark = pytest.mark.slow

IDLE_WINDOW_S = 5
"""How long the waiting driver's CPU time is measured: five of the wait's 1 s head probes
(rayload.cluster.PROBE_INTERVAL_S); a driver that spins uses a whole core in any window."""

_STATE_SCRIPT = """
import json, logging, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)
actors = ray._private.state.actors(actor_state_name="ALIVE")
groups = [g for g, i in ray.util.placement_group_table().items() if i["state"] == "CREATED"]
print(json.dumps({"actors": len(actors), "groups": len(groups)}))
"""


@dataclass(frozen=True)
class Head:
    address: str
    temp_dir: str


def _clean_env(tmp: Path) -> dict[str, str]:
    """No inherited RAY_* (no RAY_ADDRESS), token auth off, Ray's temp dir of our own (no
    ``/tmp/ray/ray_current_cluster`` of another cluster)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "RAYLOAD_"))}
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_TMPDIR"] = str(tmp)
    return env


def _kill_processes_of(temp_dir: str) -> None:
    """Kill every process of the cluster in ``temp_dir`` (what ``ray stop --force`` does)."""
    found = processes_using(temp_dir)
    for proc in found:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            continue
    psutil.wait_procs(found, timeout=10)


def _state(head: Head, env: dict[str, str]) -> dict[str, int]:
    run = subprocess.run(
        [sys.executable, "-c", _STATE_SCRIPT, head.address],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


@pytest.fixture
def start_head(tmp_path: Path) -> Iterator[Callable[[], Head]]:
    """``start_head()`` -> a fresh one-node cluster; every one started is torn down."""
    temp_dirs: list[str] = []

    def start() -> Head:
        temp_dir = tempfile.mkdtemp(prefix="rl-fault-", dir="/tmp")
        temp_dirs.append(temp_dir)
        gcs, dashboard, client, agent, agent_grpc, metrics, runtime_env = free_ports(7)
        command = [
            RAY, "start", "--head", "--block", "--disable-usage-stats",
            "--node-ip-address", "127.0.0.1",
            "--port", str(gcs),
            "--include-dashboard", "false",
            "--dashboard-port", str(dashboard),
            "--ray-client-server-port", str(client),
            "--dashboard-agent-listen-port", str(agent),
            "--dashboard-agent-grpc-port", str(agent_grpc),
            "--metrics-export-port", str(metrics),
            "--runtime-env-agent-port", str(runtime_env),
            "--num-cpus", "2",
            "--temp-dir", temp_dir,
        ]  # fmt: skip
        log = tmp_path / f"ray-start-{len(temp_dirs)}.log"
        with log.open("w") as out:
            started = subprocess.Popen(
                command,
                env=_clean_env(tmp_path),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        head = Head(address=f"127.0.0.1:{gcs}", temp_dir=temp_dir)
        deadline = time.monotonic() + 180
        while not (Path(temp_dir) / "ray_current_cluster").exists():
            assert started.poll() is None, f"ray start exited: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"ray start not up: {log.read_text()[-3000:]}"
            time.sleep(0.5)
        return head

    yield start
    for temp_dir in temp_dirs:
        _kill_processes_of(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("faults") / "tiny-llama", preset="tiny-llama")


def _load(
    checkpoint: Path, env: dict[str, str], *extra: str, hooks: object = None
) -> subprocess.Popen[str]:
    if hooks is not None:
        env = {**env, "RAYLOAD_TEST_HOOKS": json.dumps(hooks)}
    command = [RAYLOAD, "load", str(checkpoint), "--tp", "2", "--device", "cpu", *extra]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_line(proc: subprocess.Popen[str], text: str, timeout_s: float) -> list[str]:
    """Read ``proc``'s stderr until a line contains ``text``; return the lines read."""
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"exited {proc.wait()} before {text!r}: {lines}")
        lines.append(line)
        if text in line:
            return lines
    raise AssertionError(f"no {text!r} in {timeout_s:g} s: {lines}")


def _one_error_line(stderr: str) -> str:
    """Every stderr line is rayload's own (progress or the error), exactly one error."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert all(line.startswith("rayload: ") for line in lines), stderr[-3000:]
    errors = [line for line in lines if line.startswith("rayload: error: ")]
    assert len(errors) == 1, stderr[-3000:]
    return errors[0]


def _no_leaks_within(head: Head, env: dict[str, str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    state = _state(head, env)
    while state != {"actors": 0, "groups": 0}:
        assert time.monotonic() < deadline, f"left behind after {timeout_s:g} s: {state}"
        time.sleep(1)
        state = _state(head, env)


@pytest.mark.parametrize("source", ["--address", "RAY_ADDRESS", "file"])
def test_unreachable_address_exits_2_in_seconds_naming_address_and_source(
    checkpoint: Path, tmp_path: Path, source: str
) -> None:
    (port,) = free_ports(1)
    address = f"127.0.0.1:{port}"
    env, extra = _clean_env(tmp_path), ["--timeout", "30", "--json"]
    if source == "--address":
        extra += ["--address", address]
        expected = "from --address"
    elif source == "RAY_ADDRESS":
        env["RAY_ADDRESS"] = address
        expected = "from RAY_ADDRESS"
    else:
        stale = tmp_path / "ray" / "ray_current_cluster"
        stale.parent.mkdir()
        stale.write_text(address)
        expected = f"remove the stale file ({stale})"
    start = time.monotonic()
    proc = _load(checkpoint, env, *extra)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
    assert proc.returncode == 2, err[-3000:]
    error = _one_error_line(err)
    assert f"cannot reach a Ray cluster at {address}" in error and expected in error
    assert "--address local" in error
    assert json.loads(out)["kind"] == "ConfigError"  # --json: still one object on stdout
    print(f"measured: unreachable address ({source}): exit 2 after {elapsed:.1f} s")
    assert elapsed < 30, f"took {elapsed:.1f} s"


def _head_lost_while(
    checkpoint: Path, tmp_path: Path, head: Head, kill_after: str, phase: str
) -> None:
    """Load with rank 1 hung on its read, kill ``head`` once the driver prints
    ``kill_after``: exit 1 within 20 s naming ``phase``, and the trace written, its root
    ERROR."""
    trace_dir = tmp_path / f"trace-{kill_after.replace(' ', '-')}"
    proc = _load(
        checkpoint,
        _clean_env(tmp_path),
        *("--address", head.address, "--timeout", "120", "--trace-dir", str(trace_dir)),
        hooks=HANG_ON_READ,
    )
    _wait_for_line(proc, kill_after, timeout_s=90)
    _kill_processes_of(head.temp_dir)
    lost = time.monotonic()
    _, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - lost
    assert proc.returncode == 1, err[-3000:]
    error = _one_error_line(err)
    assert "head (GCS at" in error and f"stopped answering while {phase}" in error
    assert "Ray's logs: " in error
    print(f"measured: head lost after {kill_after!r}: exit 1 {elapsed:.1f} s after the kill")
    assert elapsed < 20, f"took {elapsed:.1f} s after the head was lost"
    trace = json.loads((trace_dir / "trace.otlp.json").read_text())
    spans = [s for r in trace["resourceSpans"] for sc in r["scopeSpans"] for s in sc["spans"]]
    root = [s for s in spans if s["name"] == "rayload.load"]
    assert root and root[0]["status"]["code"] == 2, "the root span has status ERROR"


def test_head_lost_while_starting_the_ranks_exits_1_in_seconds_naming_phase_with_trace(
    checkpoint: Path, tmp_path: Path, start_head: Callable[[], Head]
) -> None:
    """Ray calls that block on the dead head: the head watch ends the command."""
    _head_lost_while(
        checkpoint, tmp_path, start_head(), "placement group ready", "starting the ranks"
    )


def test_driver_waiting_on_hung_rank_idles_killed_leaves_nothing_then_head_lost_exits_1(
    checkpoint: Path, tmp_path: Path, start_head: Callable[[], Head]
) -> None:
    """On one head (one start fewer): a driver waiting on a hung rank idles, and killed
    leaves nothing; then a second load's wait on a hung rank ends, by the wait's own head
    probe, when the head is lost."""
    head = start_head()
    env = _clean_env(tmp_path)
    proc = _load(checkpoint, env, "--address", head.address, "--timeout", "45", hooks=HANG_ON_READ)
    _wait_for_line(proc, "rank actor(s) started", timeout_s=90)
    driver = psutil.Process(proc.pid)
    before, start = driver.cpu_times(), time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    after, waited = driver.cpu_times(), time.monotonic() - start
    used = (after.user + after.system - before.user - before.system) / waited
    print(f"measured: driver waiting on a hung rank used {used:.2%} of a core over {waited:.0f} s")
    assert used < 0.05, f"the waiting driver used {used:.1%} of a core"
    # What a killed driver leaves: Ray's fate sharing ends its actors, its job's end its group.
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    killed = time.monotonic()
    _no_leaks_within(head, env, timeout_s=30)
    gone = time.monotonic() - killed
    print(f"measured: killed driver's actors and group gone {gone:.1f} s later")
    _head_lost_while(
        checkpoint, tmp_path, head, "rank actor(s) started", "waiting for the ranks to load"
    )
