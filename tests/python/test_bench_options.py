"""bench/bench_options.py's flow on the CPU (tiny shape): every expert option runs, layout-only options give the
default's y, and that check can fail. The GPU run is the benchmark (the cost of each option on sm_90a)."""
import glob
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import bench_options  # noqa: E402

import megamoe  # noqa: E402

TINY = ["--device", "cpu", "--shape", "tiny", "--iters", "3"]


def test_cpu_flow(tmp_path):
    bench_options.main(TINY + ["--out", str(tmp_path)])
    (path,) = glob.glob(str(tmp_path / "*-options.json"))
    rows = json.loads(open(path).read())["rows"]
    assert list(rows) == list(bench_options.OPTIONS)
    for name, row in rows.items():
        assert row["ok"], name
        assert row["fwd_ms"] > 0 and row["fwdbwd_ms"] > 0
        layout_only = bench_options.OPTIONS[name][1:] == (megamoe.SWIGLU, False)
        assert (row["y_vs_base"] is not None) == layout_only, name
    assert "| gpt_oss |" in open(path[:-5] + ".md").read()


def test_a_wrongly_stored_layout_is_caught(tmp_path, monkeypatch):
    arrange = megamoe.arrange_weights

    def interleaved_stored_as_concatenated(w13, w2, b13=None, layout=None):
        stored = arrange(w13, w2, b13, megamoe.CONCATENATED if layout == megamoe.INTERLEAVED else layout)
        return stored

    monkeypatch.setattr(megamoe, "arrange_weights", interleaved_stored_as_concatenated)
    record = bench_options.main(TINY + ["--options", "concatenated,interleaved"])
    assert record["rows"]["concatenated"]["ok"] and not record["rows"]["interleaved"]["ok"]
