"""scripts/ab_libs.py's log readers (CPU): the digest comparison and the table of timing medians over rounds."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import ab_libs  # noqa: E402


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def round_line(build, round_idx, both, forward, graph, b2b):
    return (f"== shape-a {build} round {round_idx}: fwd+bwd {both} ms (500 TFLOP/s), forward {forward}, backward 1.0, "
            f"CUDA-graph {graph}, back to back {b2b}")


def test_compare_names_the_digests_that_differ(tmp_path, capsys):
    base = write(tmp_path / "base.log", ["digest c1 bf16 y aaaa", "digest c1 bf16 dx bbbb"])
    same = write(tmp_path / "same.log", ["digest c1 bf16 y aaaa", "digest c1 bf16 dx bbbb"])
    other = write(tmp_path / "other.log", ["digest c1 bf16 y aaaa", "digest c1 bf16 dx cccc"])
    assert ab_libs.compare([base, same]) == 0
    assert ab_libs.compare([base, other]) == 1
    out = capsys.readouterr().out
    assert "2 of 2 digests equal" in out and "1 of 2 digests equal" in out
    assert "DIFFER c1 bf16 dx: bbbb against cccc" in out
    fewer = write(tmp_path / "fewer.log", ["digest c1 bf16 y aaaa"])
    assert ab_libs.compare([base, fewer]) == 1  # a digest one log lacks differs
    assert ab_libs.compare([base, fewer], common=True) == 0
    assert "1 of 1 digests equal (1 in one log only, not compared)" in capsys.readouterr().out


def test_timing_table_takes_medians_per_build(tmp_path):
    logs = []
    for r, (both_b, both_m) in enumerate([(10.0, 11.0), (12.0, 12.0), (11.0, 30.0)], start=1):
        logs.append(write(tmp_path / f"base-r{r}.log", [round_line("base", r, both_b, 3.0, 9.0, 9.5),
                                                        "  kernel shape-a base up 2.000 ms 500 TFLOP/s"]))
        logs.append(write(tmp_path / f"main-r{r}.log", [round_line("main", r, both_m, 2.0, 9.0, 9.5),
                                                        "  kernel shape-a main up 4.000 ms 500 TFLOP/s"]))
    table = ab_libs.timing_table(logs).splitlines()
    rows = {line.split(" | ")[1]: line for line in table[2:]}
    assert rows["fwd+bwd"] == "| shape-a | fwd+bwd | 11.000 | 12.000 | 0.917 | 3/3 |"  # medians 11 and 12
    assert "| 3.000 | 2.000 | 1.500 |" in rows["forward"]
    assert "| 2.000 | 4.000 | 0.500 |" in rows["GEMM kernels (sum of medians)"]
    assert "| 2.000 | 4.000 | 0.500 |" in rows["kernel up"]
    assert ab_libs.timing_table(logs[:1]) == "fewer than two builds in these logs"


def test_timing_table_has_a_row_per_kernel_and_a_column_per_build(tmp_path):
    logs = []
    builds = (("main", {"up": 2.0, "dH": 1.0}), ("dh4", {"up": 2.0, "dH": 0.8}), ("pb8", {"up": 1.6, "dH": 1.0}))
    for build, ms in builds:
        for r in (1, 2):
            lines = [round_line(build, r, 10.0, 3.0, 9.0, 9.5)]
            lines += [f"  kernel shape-a {build} {k} {v + 0.1 * r:.3f} ms 500 TFLOP/s" for k, v in ms.items()]
            lines += [f"  host shape-a {build} fwd+bwd {0.5 + 0.1 * r:.3f} ms forward {0.2:.3f} ms"]
            logs.append(write(tmp_path / f"{build}-r{r}.log", lines))
    table = ab_libs.timing_table(logs).splitlines()
    assert table[0] == "| shape | what | main | dh4 | pb8 | main / dh4 | main / pb8 | rounds |"
    rows = {line.split(" | ")[1]: line for line in table[2:]}
    assert rows["kernel dH"] == "| shape-a | kernel dH | 1.150 | 0.950 | 1.150 | 1.211 | 1.000 | 2/2/2 |"
    assert rows["kernel up"] == "| shape-a | kernel up | 2.150 | 2.150 | 1.750 | 1.000 | 1.229 | 2/2/2 |"
    assert list(rows)[-4:] == ["kernel up", "kernel dH", "host fwd+bwd", "host forward"]
    assert rows["host fwd+bwd"] == "| shape-a | host fwd+bwd | 0.650 | 0.650 | 0.650 | 1.000 | 1.000 | 2/2/2 |"
