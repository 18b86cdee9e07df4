"""bench/readme_results.py and bench/report.py (CPU only): the README results block from committed bench JSONs (no
peers) and from a synthetic one (peers, a missing peer, recompute mode, gradient bytes, three timings, skewed
routing), the full tables, training tables, marker replacement and --check."""

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import readme_results as rr  # noqa: E402
import report  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
BENCH = os.path.join(RESULTS, "2026-11-30-nvidia-h200-7296486.json")
TRAIN_M = os.path.join(RESULTS, "2026-11-30-nvidia-h200-df891ad-train4L-megamoe.json")
TRAIN_B = os.path.join(RESULTS, "2026-11-30-nvidia-h200-df891ad-train4L-grouped_mm.json")
LOSSES = os.path.join(RESULTS, "2026-11-30-nvidia-h200-df891ad-train4L-losses.png")

SAMPLE = ("# title\r\n\nintro  with trailing spaces   \n\n## Results\n\n" + rr.BEGIN + "\nstale numbers\n| a | b |\n"
          + rr.END + "\n\n## Run it\n\n    python bench/bench.py\n\ttab — unicode ✓\nno final newline")


def tables_of(block):
    """The markdown tables of block, each a list of rows (header first), each row a list of cells."""
    tables, table = [], None
    for line in block.splitlines():
        if line.startswith("| "):
            if table is None:
                table = []
                tables.append(table)
            table.append([c.strip() for c in line.strip("|").split(" | ")])
        elif not line.startswith("|---"):
            table = None
    return tables


def rows_of(block):
    """{(shape, pass): cells} of the times tables' rows and {shape: cells} of the memory tables' rows in block."""
    out = {}
    for table in tables_of(block):
        header = table[0]
        for cells in table[1:]:
            out[(cells[0], cells[header.index("pass")]) if "pass" in header else cells[0]] = cells
    return out


SONIC_ABOUT = "sonic-moe 0.1.2.post1 on quack-kernels 0.3.11; QuACK default GEMM configs (tuned=False)"
PEERS = {"sonicmoe": {"about": SONIC_ABOUT}, "torch_compiled": {"about": "torch.compile(moe_grouped, fullgraph=True)"}}


def run(ms, tflops, peak, **more):
    return {"ms": ms, "tflops": tflops, "peak_extra_gib": peak, **more}


def synthetic(tmp_path, peers=PEERS):
    """A bench JSON with the peers, recompute mode + grad_gib, back-to-back and graph times, a skewed case, and a
    shape without fwd+bwd; plus its .png."""
    bal = {"shape": "toy-a", "routing": "balanced", "errors": {}, "grad_gib": 1.25,
           "dense": {"ms": 1.0, "tflops": 800.0, "b2b_ms": 0.9, "graph_ms": 0.95},
           "fwd": {"megamoe": run(2.0, 600.0, 0.5, b2b_ms=1.8, graph_ms=1.9), "sonicmoe": run(2.4, 500.0, 0.4),
                   "torch_compiled": run(4.0, 300.0, 1.0), "torch": run(5.0, 240.0, 1.5)},
           "fwdbwd": {"megamoe": run(8.0, 450.0, 3.0, b2b_ms=7.2, graph_ms=7.6),
                      "megamoe_recompute": run(9.5, 378.9, 2.0), "sonicmoe": run(9.6, 375.0, 2.25, b2b_ms=9.0),
                      "torch_compiled": run(10.0, 360.0, 2.5),
                      "torch": run(12.0, 300.0, 4.5, graph_error="RuntimeError: not captured: the step synchronizes")}}
    skew = {"shape": "toy-a", "routing": "skewed", "errors": {}, "dense": {"ms": 1.0, "tflops": 800.0},
            "fwd": {"megamoe": run(2.2, 540.0, 0.5), "torch": run(6.0, 200.0, 1.5)},
            "fwdbwd": {"megamoe": run(8.9, 405.0, 3.0), "torch": run(13.0, 277.0, 4.5)}}
    fwd_only = {"shape": "toy-b", "routing": "balanced", "errors": {}, "dense": {"ms": 2.0, "tflops": 700.0},
                "fwd": {"megamoe": run(4.0, 350.0, None), "torch": run(4.2, 333.0, None)}}
    results = {"date": "2027-01-02", "gpu": "Test GPU", "commit": "abc1234", "git_dirty": True, "peers": peers,
               "command": "python3 bench/bench.py --routing balanced,skewed", "cases": [bal, skew, fwd_only]}
    path = tmp_path / "results" / "2027-01-02-test-gpu-abc1234.json"
    path.parent.mkdir()
    path.write_text(json.dumps(results))
    (tmp_path / "results" / "2027-01-02-test-gpu-abc1234.png").write_bytes(b"png")
    return str(path)


def test_committed_bench_and_training():
    block = rr.generate(BENCH, ROOT, (TRAIN_M, TRAIN_B, LOSSES))
    tables = tables_of(block)
    assert len(tables) == 1 and tables[0][0] == list(rr.TIME_HEADER)  # this run measured no activation memory
    assert rr.TIME_HEADER[:8] == ("shape", "T", "H", "I", "E", "topk", "pass", "megamoe ms")
    assert rr.TIME_HEADER[8:12] == ("megamoe recompute ms", "SonicMoE ms", "torch compiled ms", "torch eager ms")
    rows = rows_of(block)
    sizes = ["16384", "2048", "768", "128", "8"]
    assert rows[("qwen3-30b-a3b", "fwd")][1:] == [*sizes, "fwd", "2.83", "—", "—", "—", "6.19", "1.63", "—", "436",
                                                  "58"]
    assert rows[("qwen3-30b-a3b", "fwd+bwd")][1:] == [*sizes, "fwd+bwd", "10.91", "—", "—", "—", "14.11", "—", "—",
                                                      "340", "45"]
    assert rows[("qwen3-235b-a22b", "fwd+bwd")][1:] == ["16384", "4096", "1536", "128", "8", "fwd+bwd", "40.37", "—",
                                                        "—", "—", "39.24", "—", "—", "368", "52"]
    assert "Peers: SonicMoE and the compiled torch path: not measured (the run predates them)." in block
    assert "NVIDIA H200" in block and "2026-11-30" in block and "commit `7296486" in block
    assert "command `MEGAMOE_SM90_WEIGHT_GRADS=1 python3 bench/bench.py" in block
    assert ("[`bench/results/2026-11-30-nvidia-h200-7296486.md`](bench/results/2026-11-30-nvidia-h200-7296486.md)"
            in block)
    assert "![TFLOP/s per shape](bench/results/2026-11-30-nvidia-h200-7296486.png)" in block
    assert "Skewed routing: not measured in this run." in block
    assert ("4 layers, batch 4 x 4096 = 16384 tokens per step" in block
            and "`megamoe` 0.220 s per step (74.3k tokens/s, peak 50.4 GiB) against the baseline `grouped_mm` 0.233 s"
            " per step (70.2k tokens/s, peak 57.4 GiB): 1.06x; largest loss difference 1.3e-03 over 10 steps" in block)
    assert "[loss curves](bench/results/2026-11-30-nvidia-h200-df891ad-train4L-losses.png)" in block
    assert "issue" not in block.lower() and "target" not in block.lower() and "session" not in block.lower()
    assert "nan" not in block.lower() and "none" not in block.lower()


def test_committed_activation_memory():
    rows = rows_of(rr.generate(os.path.join(RESULTS, "2026-11-30-nvidia-h200-fd40bb9.json"), ROOT))
    assert rows[("qwen3-30b-a3b", "fwd")][7:9] == ["2.76", "—"] and rows[("qwen3-30b-a3b", "fwd")][11] == "6.31"
    assert rows[("qwen3-30b-a3b", "fwd+bwd")][7:9] == ["8.01", "9.67"]
    assert rows["qwen3-30b-a3b"] == ["qwen3-30b-a3b", "1.69", "0.94", "—", "—", "2.13"]  # activation GiB


def test_synthetic_peers_recompute_grad_gib_skewed(tmp_path):
    path = synthetic(tmp_path)
    block = rr.generate(path, str(tmp_path))
    rows = rows_of(block)
    no_sizes = ["—"] * 5  # the synthetic cases carry no T, H, I, E, topk
    assert rows[("toy-a", "fwd")][1:] == [*no_sizes, "fwd", "2.00", "—", "2.40", "4.00", "5.00", "1.00", "1.20x",
                                          "600", "75"]
    assert rows[("toy-a", "fwd+bwd")][1:] == [*no_sizes, "fwd+bwd", "8.00", "9.50", "9.60", "10.00", "12.00", "—",
                                              "1.20x", "450", "56"]
    assert rows["toy-a"][1:] == ["1.75", "0.75", "1.00", "1.25", "3.25"]  # activation GiB
    assert rows[("toy-b", "fwd")][1:] == [*no_sizes, "fwd", "4.00", "—", "—", "—", "4.20", "2.00", "—", "350", "50"]
    assert ("toy-b", "fwd+bwd") not in rows and "toy-b" not in rows  # no fwd+bwd measured: no row
    assert sum(1 for r in rows if r[0] == "toy-a") == 2  # balanced rows only
    assert f"Peers: SonicMoE: {SONIC_ABOUT}; torch compiled: torch.compile(moe_grouped, fullgraph=True)." in block
    assert "Skewed routing (megamoe TFLOP/s skewed / balanced): toy-a fwd 0.90x, fwd+bwd 0.90x." in block
    assert "commit `abc1234 (uncommitted changes)`" in block
    assert "![TFLOP/s per shape](results/2027-01-02-test-gpu-abc1234.png)" in block
    assert ".md`]" not in block  # no .md beside the JSON: no link
    assert "Training step" not in block


def test_missing_peer_says_why(tmp_path):
    why = "not installed: ModuleNotFoundError: No module named 'sonicmoe'"
    path = synthetic(tmp_path, peers={"sonicmoe": {"missing": why}})
    block = rr.generate(path, str(tmp_path))
    assert f"Peers: SonicMoE: missing ({why}); torch compiled: not run (--peers)." in block
    results = json.loads(open(path).read())
    for case in results["cases"]:
        report.derive(case)
    sonic = [r for r in report.table_rows(results) if r[3] == "SonicMoE" and r[0] == "toy-b"]
    assert sonic and all(r[-1] == f"missing: {why}" for r in sonic)


def test_report_tables_of_three_timings(tmp_path):
    results = json.loads(open(synthetic(tmp_path)).read())
    for case in results["cases"]:
        report.derive(case)
    rows = {(r[0], r[1], r[2], r[3]): r[4:] for r in report.table_rows(results)}
    assert rows[("toy-a", "balanced", "fwd", "megamoe")][:4] == ["2.00 / 1.80 / 1.90", "600 / — / —",
                                                                  "75 / — / —", "—"]
    assert rows[("toy-a", "balanced", "fwd+bwd", "SonicMoE")] == ["9.60 / 9.00 / —", "375 / — / —", "47 / — / —",
                                                                  "1.20x / 1.25x / —", "2.25", "1.00", "—", "ok"]
    assert rows[("toy-a", "balanced", "fwd+bwd", "torch eager")][-1] == (
        "graph: RuntimeError: not captured: the step synchronizes")
    assert rows[("toy-a", "balanced", "fwd+bwd", "dense bf16 GEMM")][0] == "3.00 / 2.70 / 2.85"
    assert ("toy-a", "balanced", "fwd", "megamoe recompute") not in rows
    b2b = {r[0]: r for r in report.summary_rows(results, "b2b_")}
    assert b2b["toy-a (balanced)"][1] == "1.80 / 7.20 (1.75)" and b2b["toy-a (balanced)"][3] == "— / 9.00 (1.00)"
    assert b2b["toy-a (balanced)"][6:8] == ["0.90", "— / 1.25x"]
    md = report.markdown(results, "x.png")
    assert "## Per call" in md and "## Back to back" in md and "## CUDA graph" in md and "## All numbers" in md


def test_synthetic_training(tmp_path):
    args = {"layers": 2, "steps": 4, "warmup": 1, "seq": 64, "batch": 2, "dtype": "bf16", "tiny": True}
    logs = []
    for impl, step, losses in (("megamoe", 0.5, [5.0, 4.0, 3.0, 2.5]), ("eager", 0.8, [5.0, 4.002, 2.999])):
        rec = {"experts_impl": impl, "args": dict(args, experts_impl=impl), "device": "cpu", "median_step_s": step,
               "tokens_per_s": 256 / step, "peak_memory_gib": None, "losses": losses}
        logs.append(tmp_path / f"run-{impl}.json")
        logs[-1].write_text(json.dumps(rec))
    block = "\n".join(rr.train_section(*(json.loads(p.read_text()) for p in logs), None, str(tmp_path)))
    assert ("a tiny Qwen3-MoE config with 2 layers, batch 2 x 64 = 128 tokens per step" in block
            and "`megamoe` 0.500 s per step (0.5k tokens/s, peak — GiB) against the baseline `eager` 0.800 s per step"
            " (0.3k tokens/s, peak — GiB): 1.60x; largest loss difference 2.0e-03 over 3 steps." in block)
    assert "[loss curves]" not in block and not rows_of(block)


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
    assert "-stale numbers" in out.out and "+| qwen3-30b-a3b | 16384 | 2048 | 768 | 128 | 8 | fwd | 2.83 |" in out.out
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


def test_other_shapes_from_earlier_runs(tmp_path):
    path = synthetic(tmp_path)
    rec = json.loads(open(path).read())
    older = dict(rec, date="2027-01-01", commit="0000001", cases=[dict(c, shape="toy-f") for c in rec["cases"]]
                 + [c for c in rec["cases"] if c["routing"] == "balanced"])
    oldest = dict(rec, date="2026-12-31", commit="0000002", cases=[dict(c, shape="toy-f") for c in rec["cases"]]
                  + [dict(c, shape="toy-c") for c in rec["cases"] if c["routing"] == "balanced"])
    no_peers = dict(rec, date="2026-12-30", commit="0000003", peers={},
                    cases=[dict(c, shape="toy-d") for c in rec["cases"] if c["routing"] == "balanced"])
    newer = dict(rec, date="2027-02-01", commit="0000004", cases=[dict(c, shape="toy-e") for c in rec["cases"]])
    results = os.path.dirname(path)
    for name, record in (("older", older), ("oldest", oldest), ("no-peers", no_peers), ("newer", newer)):
        with open(os.path.join(results, f"{name}.json"), "w") as f:
            json.dump(record, f)
    others = rr.runs_for_other_shapes(path, results)
    # toy-a and toy-b are in the run itself, toy-f comes from the newest earlier run, toy-c from the next; toy-d's run has no
    # peers and toy-e's is newer than the run shown
    assert [(os.path.basename(p), shapes) for p, shapes in others] == [("older.json", ["toy-f"]),
                                                                       ("oldest.json", ["toy-c"])]
    block = rr.generate(path, str(tmp_path), others=others)
    shapes = {key[0] for key in rows_of(block) if isinstance(key, tuple)}  # the times tables' (shape, pass)
    assert {"toy-a", "toy-b", "toy-f", "toy-c"} <= shapes and "toy-d" not in shapes and "toy-e" not in shapes
    assert "toy-f: the newest run of this shape (2027-01-01, commit `0000001`" in block
