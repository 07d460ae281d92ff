"""``rayload bench --checkpoint s3://...`` against the tests' real S3 server (moto behind
the counting proxy of tests/support/s3.py): the ranks fetch their ranges from the server,
the limit is the server's, nothing of the checkpoint is copied to this machine, and what
does not apply to object storage is said, not faked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rayload.cli import main
from support.cli import assert_one_line_error, run_cli
from support.s3 import CANARY, S3Server, s3_server


@pytest.fixture(scope="module")
def s3() -> S3Server:
    return s3_server()


@pytest.fixture(scope="module")
def bench_url(s3: S3Server, bench_checkpoint: Path) -> str:
    return s3.upload(bench_checkpoint, "bench", "tiny-llama")


def test_bench_of_an_s3_checkpoint_fetches_from_the_server_and_copies_nothing_locally(
    s3: S3Server, bench_url: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    s3.proxy.clear()
    argv = [
        "bench",
        "--checkpoint",
        bench_url,
        "--tp",
        "2",
        "--repeat",
        "1",
        "--methods",
        "scratch",
        "safe_open_slice",
        "converted",
        "--out",
        str(tmp_path / "out"),
        "--workdir",
        str(work),
        "--no-startup",
    ]
    assert main(argv) == 0
    out, err = capfd.readouterr()
    (tmp_path.parent / "s3-bench-out.md").write_text(out + "\n---\n" + err)
    assert "| scratch | 2 |" in out and "| limit | 1 |" in out
    assert "## remote storage (no page cache)" in out and "page cache\n" not in out
    assert "- storage: s3, endpoint 127.0.0.1, bucket bench" in out
    for case in ("safe_open_slice", "converted"):
        assert f"- skipped `{case}`:" in out
    assert "split probe: it writes one-layer subsets" in err
    assert not work.exists(), "something was written to local disk"
    assert CANARY not in out + err

    (report,) = (tmp_path / "out").glob("bench-*.json")
    result = json.loads(report.read_text())
    assert result["consistency"] == [] and result["references"], "not verified"
    assert result["storage"]["kind"] == "s3" and result["config"]["caches"] == ["remote"]
    size = result["checkpoint"]["bytes"]
    by_case = {s["case"]: s for s in result["samples"]}
    assert set(by_case) == {"limit", "scratch"}
    limit = by_case["limit"]["ranks"][0]
    assert limit["storage_bytes"] >= size - 4096  # every byte of every object, headers too
    scratch = by_case["scratch"]["ranks"]
    assert all(r["effective"] == "scratch" and r["storage_bytes"] > 0 for r in scratch)
    assert all(r["bytes_read"] == r["storage_bytes"] for r in [limit, *scratch])
    # The server's own count: the limit's, the ranks', then the reference's.
    served = s3.proxy.served_bytes("bench/tiny-llama/")
    assert served >= size + sum(r["storage_bytes"] for r in scratch)


@pytest.mark.parametrize("states", [["cold"], ["cold", "warm"]])
def test_bench_of_an_s3_checkpoint_refuses_page_cache_states(
    bench_url: str, states: list[str]
) -> None:
    # cold warm too: the files' default, but asked for.
    run = run_cli("bench", "--checkpoint", bench_url, "--cache", *states)
    assert_one_line_error(run, "--cache does not apply to s3://bench/tiny-llama")
