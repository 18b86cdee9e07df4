"""bench/readme_results.py (CPU only): the README results block from a committed bench JSON and from a synthetic
one (recompute mode, gradient bytes, skewed routing), training tables, marker replacement and --check."""

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import readme_results as rr  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
BENCH = os.path.join(RESULTS, "2026-11-30-nvidia-h200-7296486.json")
TRAIN_M = os.path.join(RESULTS, "2026-11-30-nvidia-h200-df891ad-train4L-megamoe.json")
TRAIN_B = os.path.join(RESULTS, "2026-11-30-nvidia-h200-df891ad-train4L-grouped_mm.json")
LOSSES = os.path.join(RESULTS, "2026-11-30-nvidia-h200-df891ad-train4L-losses.png")

SAMPLE = ("# title\r\n\nintro  with trailing spaces   \n\n## Results\n\n" + rr.BEGIN + "\nstale numbers\n| a | b |\n"
          + rr.END + "\n\n## Run it\n\n    python bench/bench.py\n\ttab — unicode ✓\nno final newline")


def rows_of(block):
    """{first cell: [cells]} of every markdown table row in block."""
    out = {}
    for line in block.splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            cells = [c.strip() for c in line.strip("|").split(" | ")]
            out[cells[0]] = cells
    return out


def synthetic(tmp_path):
    """A bench JSON with recompute mode + grad_gib, a skewed case, and a shape without fwd+bwd; plus its .png."""
    def run(ms, tflops, peak):
        return {"ms": ms, "tflops": tflops, "peak_extra_gib": peak}

    bal = {"shape": "toy-a", "routing": "balanced", "errors": {}, "grad_gib": 1.25,
           "dense": {"ms": 1.0, "tflops": 800.0},
           "fwd": {"megamoe": run(2.0, 600.0, 0.5), "torch": run(5.0, 240.0, 1.5)},
           "fwdbwd": {"megamoe": run(8.0, 450.0, 3.0), "megamoe_recompute": run(9.5, 378.9, 2.0),
                      "torch": run(12.0, 300.0, 4.5)}}
    skew = {"shape": "toy-a", "routing": "skewed", "errors": {}, "dense": {"ms": 1.0, "tflops": 800.0},
            "fwd": {"megamoe": run(2.2, 540.0, 0.5), "torch": run(6.0, 200.0, 1.5)},
            "fwdbwd": {"megamoe": run(8.9, 405.0, 3.0), "torch": run(13.0, 277.0, 4.5)}}
    fwd_only = {"shape": "toy-b", "routing": "balanced", "errors": {}, "dense": {"ms": 2.0, "tflops": 700.0},
                "fwd": {"megamoe": run(4.0, 350.0, None), "torch": run(4.2, 333.0, None)}}
    results = {"date": "2027-01-02", "gpu": "Test GPU", "commit": "abc1234", "git_dirty": True,
               "command": "python3 bench/bench.py --routing balanced,skewed", "cases": [bal, skew, fwd_only]}
    path = tmp_path / "results" / "2027-01-02-test-gpu-abc1234.json"
    path.parent.mkdir()
    path.write_text(json.dumps(results))
    (tmp_path / "results" / "2027-01-02-test-gpu-abc1234.png").write_bytes(b"png")
    return str(path)


def test_committed_bench_and_training():
    block = rr.generate(BENCH, ROOT, (TRAIN_M, TRAIN_B, LOSSES))
    rows = rows_of(block)
    assert rows["qwen3-30b-a3b"][1:] == ["2.83 / 6.19 (2.19x)", "436 (58%)", "10.91 / 14.11 (1.29x)", "340 (45%)",
                                         "—", "2.81 / — / 3.31", "— / — / —"]
    assert rows["qwen3-235b-a22b"][1:5] == ["10.18 / 15.41 (1.51x)", "486 (68%)", "40.37 / 39.24 (0.97x)", "368 (52%)"]
    assert "NVIDIA H200" in block and "2026-11-30" in block and "commit `7296486" in block
    assert "command `MEGAMOE_SM90_WEIGHT_GRADS=1 python3 bench/bench.py" in block
    assert ("[`bench/results/2026-11-30-nvidia-h200-7296486.md`](bench/results/2026-11-30-nvidia-h200-7296486.md)"
            in block)
    assert "![TFLOP/s per shape](bench/results/2026-11-30-nvidia-h200-7296486.png)" in block
    assert "Skewed routing: not measured in this run." in block
    assert rows["`megamoe`"][1:] == ["4", "16384", "0.220", "74.3k", "50.4", "1.06x", "1.3e-03 over 10 steps"]
    assert rows["`grouped_mm` (baseline)"][1:] == ["4", "16384", "0.233", "70.2k", "57.4", "1.00x", "—"]
    assert "[plot](bench/results/2026-11-30-nvidia-h200-df891ad-train4L-losses.png)" in block
    assert "forward >= 3.11x" in block and ">= 1.34x" in block
    assert "nan" not in block.lower() and "none" not in block.lower()


def test_synthetic_recompute_grad_gib_skewed(tmp_path):
    path = synthetic(tmp_path)
    block = rr.generate(path, str(tmp_path))
    rows = rows_of(block)
    assert rows["toy-a"][1:] == ["2.00 / 5.00 (2.50x)", "600 (75%)", "8.00 / 12.00 (1.50x)", "450 (56%)", "9.50",
                                 "3.00 / 2.00 / 4.50", "1.75 / 0.75 / 3.25"]
    assert rows["toy-b"][1:] == ["4.00 / 4.20 (1.05x)", "350 (50%)", "—", "—", "—", "—", "—"]
    assert sum(1 for r in rows if r.startswith("toy-a")) == 1  # balanced rows only
    assert "Skewed routing (megamoe TFLOP/s skewed / balanced): toy-a fwd 0.90x, fwd+bwd 0.90x." in block
    assert "commit `abc1234 (uncommitted changes)`" in block
    assert "![TFLOP/s per shape](results/2027-01-02-test-gpu-abc1234.png)" in block
    assert ".md`]" not in block  # no .md beside the JSON: no link
    assert "Training step" not in block


def test_synthetic_training(tmp_path):
    args = {"layers": 2, "steps": 4, "warmup": 1, "seq": 64, "batch": 2, "dtype": "bf16", "tiny": True}
    logs = []
    for impl, step, losses in (("megamoe", 0.5, [5.0, 4.0, 3.0, 2.5]), ("eager", 0.8, [5.0, 4.002, 2.999])):
        rec = {"experts_impl": impl, "args": dict(args, experts_impl=impl), "device": "cpu", "median_step_s": step,
               "tokens_per_s": 256 / step, "peak_memory_gib": None, "losses": losses}
        logs.append(tmp_path / f"run-{impl}.json")
        logs[-1].write_text(json.dumps(rec))
    block = "\n".join(rr.train_section(*(json.loads(p.read_text()) for p in logs), None, str(tmp_path)))
    rows = rows_of(block)
    assert rows["`megamoe`"][1:] == ["2", "128", "0.500", "0.5k", "—", "1.60x", "2.0e-03 over 3 steps"]
    assert rows["`eager` (baseline)"][1:] == ["2", "128", "0.800", "0.3k", "—", "1.00x", "—"]
    assert "tiny" in block and "[plot]" not in block


def test_replace_keeps_everything_else():
    new = rr.replace_block(SAMPLE, "NEW BLOCK")
    i, j = SAMPLE.index(rr.BEGIN) + len(rr.BEGIN), SAMPLE.index(rr.END)
    assert new.startswith(SAMPLE[:i]) and new.endswith(SAMPLE[j:])
    assert new[len(SAMPLE[:i]):len(new) - len(SAMPLE[j:])] == "\n\nNEW BLOCK\n\n"
    assert "stale numbers" not in new
    assert rr.replace_block(new, "NEW BLOCK") == new  # idempotent
    assert rr.replace_block(new, "OTHER").replace("OTHER", "NEW BLOCK") == new


def test_missing_markers(tmp_path, capsys):
    for text in ("## Results\n\nno markers\n", rr.BEGIN + " only begin\n", rr.END + "\n" + rr.BEGIN + "\n"):
        with pytest.raises(ValueError, match="markers not found"):
            rr.replace_block(text, "x")
    readme = tmp_path / "README.md"
    readme.write_text("## Results\n\nno markers\n")
    assert rr.main(["--bench", BENCH, "--no-train", "--readme", str(readme)]) == 2
    assert "markers not found" in capsys.readouterr().err
    assert readme.read_text() == "## Results\n\nno markers\n"


def test_check_and_write(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_bytes(SAMPLE.encode())
    argv = ["--bench", BENCH, "--train-megamoe", TRAIN_M, "--train-baseline", TRAIN_B, "--readme", str(readme)]
    assert rr.main(argv + ["--check"]) == 1
    out = capsys.readouterr()
    assert "-stale numbers" in out.out and "+| qwen3-30b-a3b | 2.83 / 6.19 (2.19x)" in out.out
    assert "out of date" in out.err
    assert readme.read_bytes() == SAMPLE.encode()  # --check never writes
    assert rr.main(argv) == 0
    text = readme.read_bytes().decode()
    assert text.startswith(SAMPLE[:SAMPLE.index(rr.BEGIN)]) and text.endswith(SAMPLE[SAMPLE.index(rr.END):])
    assert "\r\n" in text and text.endswith("no final newline")
    capsys.readouterr()
    assert rr.main(argv + ["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
    assert rr.main(["--bench", BENCH, "--no-train", "--readme", str(readme), "--check"]) == 1  # training table gone


def test_newest_by_content_not_mtime(tmp_path):
    for name, date in (("a-new.json", "2026-12-05"), ("z-old.json", "2026-11-01")):
        shutil.copy(BENCH, tmp_path / name)
        rec = json.loads((tmp_path / name).read_text())
        rec.update(date=date, commit="fffffff")
        (tmp_path / name).write_text(json.dumps(rec))
    os.utime(tmp_path / "a-new.json", (1, 1))  # oldest mtime, newest content
    shutil.copy(TRAIN_M, tmp_path / "train.json")  # not a bench JSON
    assert rr.newest_bench(str(tmp_path)) == str(tmp_path / "a-new.json")
    assert rr.newest_bench(str(tmp_path / "nothing")) is None


def test_newest_by_commit_order():
    if rr._commit_rank("31a8a6c") < 0 or rr._commit_rank("df891ad") < 0:
        pytest.skip("git history of the results' commits not available")
    assert rr._commit_rank("df891ad") > rr._commit_rank("31a8a6c")  # same date: the later commit wins
    m, b, png = rr.newest_train()
    assert m.endswith("-megamoe.json") and b and png.endswith("-losses.png")


def test_skewed_companion_file(tmp_path):
    path = synthetic(tmp_path)
    rec = json.loads(open(path).read())
    skewed = dict(rec, cases=[c for c in rec["cases"] if c["routing"] == "skewed"], commit="abc1234")
    rec["cases"] = [c for c in rec["cases"] if c["routing"] == "balanced"]
    open(path, "w").write(json.dumps(rec))
    companion = path[:-5] + rr.SKEWED_SUFFIX
    open(companion, "w").write(json.dumps(skewed))
    assert rr.newest_bench(os.path.dirname(path)) == path  # the companion is never chosen itself
    block = rr.generate(path, str(tmp_path))
    assert ("Skewed routing (a separate run, commit `abc1234`: [`results/2027-01-02-test-gpu-abc1234-skewed.md`]"
            "(results/2027-01-02-test-gpu-abc1234-skewed.md)) (megamoe TFLOP/s skewed / balanced): toy-a fwd 0.90x,"
            " fwd+bwd 0.90x." in block)
    os.remove(companion)
    assert "Skewed routing: not measured in this run." in rr.generate(path, str(tmp_path))


def test_skewed_run_of_an_earlier_commit(tmp_path):
    path = synthetic(tmp_path)
    rec = json.loads(open(path).read())
    skewed = dict(rec, cases=[c for c in rec["cases"] if c["routing"] == "skewed"], commit="0000001",
                  date="2027-01-01")
    older_balanced = dict(rec, cases=[dict(c, fwd=dict(c["fwd"], megamoe=dict(c["fwd"]["megamoe"], tflops=270.0)))
                                      for c in rec["cases"] if c["routing"] == "balanced"], commit="0000001",
                          date="2027-01-01")
    rec["cases"] = [c for c in rec["cases"] if c["routing"] == "balanced"]
    open(path, "w").write(json.dumps(rec))
    results_dir = os.path.dirname(path)
    open(os.path.join(results_dir, "2027-01-01-test-gpu-0000001" + rr.SKEWED_SUFFIX), "w").write(json.dumps(skewed))
    open(os.path.join(results_dir, "2027-01-01-test-gpu-0000001.json"), "w").write(json.dumps(older_balanced))
    newer = dict(skewed, date="2027-02-01")  # newer than the bench run: never used for it
    open(os.path.join(results_dir, "2027-02-01-test-gpu-0000002" + rr.SKEWED_SUFFIX), "w").write(json.dumps(newer))
    block = rr.generate(path, str(tmp_path))
    assert ("Skewed routing (a separate run, commit `0000001`, against that commit's balanced run:"
            " [`results/2027-01-01-test-gpu-0000001-skewed.md`]" in block)
    assert "toy-a fwd 2.00x, fwd+bwd 0.90x." in block  # 540 / 270 from the older balanced run
