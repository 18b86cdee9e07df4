"""bench/bench_small_batch.py's flow on the CPU (tiny shape): every batch size runs megamoe and the torch path, each
checked against the fp32 reference before it is timed, with the weight-read floor; and the check can fail. The GPU
run is the benchmark (small batches at qwen3-30b-a3b's experts)."""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import bench_small_batch  # noqa: E402

import megamoe  # noqa: E402

TINY = ["--device", "cpu", "--shape", "tiny", "--batches", "1,8", "--iters", "3"]


def test_cpu_flow(tmp_path):
    assert bench_small_batch.main(TINY + ["--out", str(tmp_path)]) == 0
    (path,) = glob.glob(str(tmp_path / "*-small-batch.json"))
    record = json.loads(open(path).read())
    assert [row["T"] for row in record["rows"]] == [1, 8]
    for row in record["rows"]:
        assert 1 <= row["floor"]["experts_touched"] <= record["E"]
        assert 0 < row["floor"]["fwd"] < row["floor"]["fwdbwd"]
        mine = row["impls"]["megamoe"]
        assert mine["ok"] and mine["y_err"] < bench_small_batch.BF16_BOUND
        for p in ("fwd", "fwdbwd"):
            assert mine[p]["ms"] > 0 and mine[p]["graph_ms"] > 0, p
    assert "| 8 |" in open(path[:-5] + ".md").read()


def test_a_wrong_answer_is_not_timed(tmp_path, monkeypatch):
    real = megamoe.moe
    monkeypatch.setattr(megamoe, "moe", lambda *args, **kwargs: real(*args, **kwargs) * 1.1)
    assert bench_small_batch.main(TINY) == 1
