"""bench/bench_ep.py on the CPU: the whole flow under torchrun with 2 gloo processes on the tiny shape (EP = 1 and 2,
checked against EP = 1 before timing), and its baseline's expert order."""

import glob
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import ep_baseline  # noqa: E402


def test_baseline_expert_order():
    counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    recv_of_grouped, grouped_of_recv = ep_baseline.expert_order(counts, 7)
    assert recv_of_grouped.tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert torch.equal(grouped_of_recv[recv_of_grouped], torch.arange(7))


def test_bench_ep_runs_under_torchrun_on_cpu(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(ROOT, "bench", "bench_ep.py"), "--device", "cpu", "--shapes", "tiny", "--ep", "1,2,4",
           "--chunks", "1,3", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    assert "skipped: tiny EP=4" in r.stdout and "torchtitan-style" in r.stdout
    (path,) = glob.glob(str(tmp_path / "*-ep.json"))
    results = json.load(open(path))
    assert results["world"] == 2 and results["backend"] == "gloo"
    rows = results["rows"]
    assert {(row["ep"], row["impl"]) for row in rows} == {
        (ep, impl) for ep in (1, 2) for impl in ("megamoe C=1", "megamoe C=3", "torchtitan-style")}
    for row in rows:
        assert row["check_rel_err"] < 2e-2, row
        assert row["fwdbwd_tokens_per_s_per_gpu"] > 0 and 0 < row["fwdbwd_comm_share"]
    assert os.path.exists(path[:-len(".json")] + ".md")
