"""Run by the ``job_submit_run`` background run (tests/conftest.py) for
test_job_submit.py: its own one-node cluster from ``ray start --head --block`` (own ports,
own temp dir, token auth off for it and its clients: ``RAY_AUTH_MODE=disabled``, set alike
for ``ray start`` and ``ray job``), then examples/job_submit.py through ``ray job submit``
with its load options from a config file and ``--tp`` overriding the file's ``tp_size``.
The cluster is stopped by killing only its own processes: never ``ray stop``, which would
stop every Ray on the machine.

Prints one JSON object: the token ids, the submit's exit code, stdout and stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
TOKEN_IDS = [7, 300, 42, 5]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that were free a moment ago."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def processes_using(temp_dir: str) -> list[psutil.Process]:
    """The processes of the cluster whose temp dir is ``temp_dir`` (on their command line)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if any(temp_dir in part for part in proc.info["cmdline"] or ()):
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _wait_until_serving(
    urls: list[str], head: subprocess.Popen[str], timeout_s: float, said: Callable[[], str]
) -> None:
    """Until each of ``urls`` answers HTTP (any status): the dashboard, and the head's
    dashboard agent, whose address the dashboard looks up for ``ray job submit``. The agent
    registers it right after its HTTP server starts; a submit before that waits 10 s on the
    dashboard, then fails "No available agent to submit job" (seen in CI under load).
    ``said()``: the end of ``ray start``'s output, for the error when it exits."""
    deadline = time.monotonic() + timeout_s
    for url in urls:
        while True:
            if head.poll() is not None:
                raise AssertionError(f"ray start exited with {head.returncode}: {said()}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except urllib.error.HTTPError:
                break  # it answered
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                if time.monotonic() > deadline:
                    raise AssertionError(f"{url} did not answer in {timeout_s:.0f} s") from None
                time.sleep(0.5)


def job_env() -> dict[str, str]:
    """The environment of the cluster's processes and its clients: this one without its
    ``RAY_*`` variables, token auth off (``RAY_AUTH_MODE=disabled``, set alike for ``ray
    start`` and ``ray job``), and this virtualenv's ``python`` first on ``PATH`` (the job's
    entrypoint runs ``python``, as in an activated environment)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["RAY_AUTH_MODE"] = "disabled"
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


@contextmanager
def head_node(env: dict[str, str]) -> Iterator[tuple[str, str]]:
    """A one-node cluster (``env``: its processes' environment); yields its dashboard URL
    and its temp dir (removed afterwards)."""
    temp_dir = tempfile.mkdtemp(prefix="rl-job-", dir="/tmp")
    gcs, dashboard, client, agent, agent_grpc, metrics, runtime_env = free_ports(7)
    command = [
        RAY, "start", "--head", "--block",
        "--node-ip-address", "127.0.0.1",
        "--port", str(gcs),
        "--dashboard-host", "127.0.0.1",
        "--dashboard-port", str(dashboard),
        "--ray-client-server-port", str(client),
        "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(agent_grpc),
        "--metrics-export-port", str(metrics),
        "--runtime-env-agent-port", str(runtime_env),
        "--num-cpus", "2",
        "--temp-dir", temp_dir,
    ]  # fmt: skip
    output = Path(temp_dir) / "ray-start.log"
    with output.open("w") as log:
        head = subprocess.Popen(
            command,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )

    def said() -> str:
        return output.read_text(errors="replace")[-3000:]

    url = f"http://127.0.0.1:{dashboard}"
    try:
        _wait_until_serving([f"{url}/api/version", f"http://127.0.0.1:{agent}/"], head, 120, said)
        yield url, temp_dir
    finally:
        head.send_signal(signal.SIGINT)  # `ray start --block` stops its processes on ^C
        try:  # gracefully: 1-2 s alone, but it once took 30 s under CI's load
            head.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=10)
        leftovers = processes_using(temp_dir)
        for proc in leftovers:
            proc.kill()
        psutil.wait_procs(leftovers, timeout=10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def main() -> None:
    workdir = Path(sys.argv[1])
    env = job_env()
    # The load's options from a config file (the job runs on this machine: it reads it).
    config = workdir / "load.yaml"
    config.write_text("tp_size: 4\nmethod: scratch\ndevice: cpu\n")
    with head_node(env) as (dashboard, _):
        submit = [
            RAY, "job", "submit",
            "--address", dashboard,
            "--working-dir", str(REPO / "examples"),
            "--", "python", "job_submit.py", "--config", str(config), "--tp", "2",
            "--token-ids", *map(str, TOKEN_IDS),
        ]  # fmt: skip
        run = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=300)
    out = {
        "token_ids": TOKEN_IDS,
        "returncode": run.returncode,
        "stdout": run.stdout,
        "stderr": run.stderr,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
