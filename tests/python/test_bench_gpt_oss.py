"""bench/bench_gpt_oss.py's flow on the CPU (tiny sizes): megamoe's gpt-oss experts against HF's eager ones, its
record and table. The GPU run is the benchmark; this checks the script and that its correctness check can fail."""
import glob
import json
import os
import sys

import pytest

transformers = pytest.importorskip("transformers", minversion="5.0", reason="transformers 5.x not installed")
if not hasattr(transformers, "GptOssConfig"):
    pytest.skip(f"transformers {transformers.__version__} has no gpt-oss model", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import bench_gpt_oss  # noqa: E402

TINY = ["--device", "cpu", "--tokens", "48", "--hidden", "64", "--intermediate", "40", "--experts", "8", "--topk",
        "2", "--iters", "3", "--impls", "megamoe"]


def test_cpu_flow(tmp_path):
    bench_gpt_oss.main(TINY + ["--out", str(tmp_path)])
    (path,) = glob.glob(str(tmp_path / "*-gpt-oss.json"))
    record = json.loads(open(path).read())
    assert set(record["errors"]) == {"megamoe", "eager"} and set(record["times"]) == {"megamoe"}
    names = {"y", "dx", "d routing weights", "d down_proj", "d down_proj_bias", "d gate_up_proj",
             "d gate_up_proj_bias"}
    assert set(record["errors"]["megamoe"]) == names
    # megamoe in bf16 within a small multiple of HF's eager experts in bf16, both against eager in fp32
    assert max(record["errors"]["megamoe"].values()) < 3 * max(record["errors"]["eager"].values()) + 1e-3
    assert "| megamoe |" in open(path[:-5] + ".md").read()


def test_wrong_activation_is_caught(tmp_path, monkeypatch):
    import megamoe

    monkeypatch.setattr(megamoe.hf, "clamped_swiglu", lambda limit, alpha: megamoe.clamped_swiglu(limit, alpha + 1.0))
    bench_gpt_oss.main(TINY + ["--out", str(tmp_path)])
    (path,) = glob.glob(str(tmp_path / "*-gpt-oss.json"))
    assert json.loads(open(path).read())["errors"]["megamoe"]["y"] > 1e-2
