"""bench/bench_cpu.py runs (each case once, briefly) and prints one line per case; it times, it asserts no speed."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import bench_cpu  # noqa: E402


def test_every_case_runs_and_prints_its_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench_cpu.py", "--seconds", "0.01"])
    bench_cpu.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("megamoe ")
    assert [line.split()[0] for line in lines[1:]] == list(bench_cpu.CASES)
    assert all(" ms/call " in line for line in lines[1:])
