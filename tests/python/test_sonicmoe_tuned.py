"""SonicMoE's two peers on the CPU: `sonicmoe` (QuACK's default GEMM configs, tuned=False) and `sonicmoe-tuned`
(QuACK's autotuned GEMMs) in one process, against stand-ins of quack.gemm_interface and sonicmoe's modules that call
the GEMMs by the names they imported, as sonicmoe does: each variant's forward and backward run its own GEMMs, in any
order of loading and calling, through the bench flow too; megamoe's speed-up over SonicMoE is over the faster variant,
named, in the report and the README tables, and results without sonicmoe-tuned render as before; the QuACK cache
folder packs and unpacks (scripts/quack_cache.sh)."""

import json
import os
import subprocess
import sys
import types
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import impls  # noqa: E402
import peers  # noqa: E402
import readme_results as rr  # noqa: E402
import report  # noqa: E402
import timing  # noqa: E402
import workloads  # noqa: E402
from reference import path_outputs  # noqa: E402

TINY = workloads.TEST_SHAPES["tiny"]

# sonicmoe.functional.forward / backward as sonicmoe writes them: the GEMMs imported by name, looked up when called.
FORWARD_SRC = """
from quack.gemm_interface import gemm, gemm_gated
def forward_gemms():
    return [gemm_gated("up"), gemm("down")]
"""
BACKWARD_SRC = """
from quack.gemm_interface import gemm, gemm_dgated
def backward_gemms():
    return [gemm_dgated("dgated"), gemm("dw")]
"""


class Backward(torch.autograd.Function):
    """Identity whose backward runs the backward module's GEMMs first (where sonicmoe's backward would)."""

    @staticmethod
    def forward(ctx, y, log):
        ctx.log = log
        return y.clone()

    @staticmethod
    def backward(ctx, dy):
        ctx.log.append(("bwd", sys.modules["sonicmoe.functional.backward"].backward_gemms()))
        return dy, None


def fake_quack_and_sonic(monkeypatch, forward_names=("gemm", "gemm_gated")):
    """Stand-ins in sys.modules; returns the log of (phase, [(gemm, tuned), ...]) of every forward and backward."""
    log = []

    def gemm_fn(name):
        def fn(tag, tuned=True, **kw):
            return tag, tuned
        fn.__name__ = name
        return fn
    quack, gi = types.ModuleType("quack"), types.ModuleType("quack.gemm_interface")
    for n in peers.QUACK_GEMMS:
        setattr(gi, n, gemm_fn(n))
    quack.gemm_interface = gi
    monkeypatch.setitem(sys.modules, "quack", quack)
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", gi)
    fwd, bwd = types.ModuleType("sonicmoe.functional.forward"), types.ModuleType("sonicmoe.functional.backward")
    exec(FORWARD_SRC if forward_names == ("gemm", "gemm_gated") else FORWARD_SRC.replace(", gemm_gated", ""),
         fwd.__dict__)
    exec(BACKWARD_SRC, bwd.__dict__)

    def moe(x, scores, tokens, experts, w1, b1, w2, b2, E, stream, activation, inference):
        """moe_general_routing_inputs in plain torch (w1 [2I, H, E] gate / up rows interleaved, w2 [H, I, E])."""
        log.append(("fwd", sys.modules["sonicmoe.functional.forward"].forward_gemms()))
        W1, W2 = w1.permute(2, 0, 1).float(), w2.permute(2, 0, 1).float()  # [E, 2I, H], [E, H, I]
        e, t = experts.long(), tokens.long()
        xs = x[t].float()  # [S, H]
        a = (F.silu(torch.einsum("sh,sih->si", xs, W1[e, 0::2])) * torch.einsum("sh,sih->si", xs, W1[e, 1::2]))
        o = scores[:, None] * torch.einsum("si,shi->sh", a, W2[e])  # [S, H]
        y = torch.zeros(x.shape, dtype=torch.float32).index_add(0, t, o).to(x.dtype)
        return (Backward.apply(y, log) if torch.is_grad_enabled() else y), None

    top, enums = types.ModuleType("sonicmoe"), types.ModuleType("sonicmoe.enums")
    top.moe_general_routing_inputs = moe
    enums.ActivationType = SimpleNamespace(SWIGLU="swiglu")
    for name, mod in {"sonicmoe": top, "sonicmoe.enums": enums, "sonicmoe.functional.forward": fwd,
                      "sonicmoe.functional.backward": bwd}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return log


def expect(tuned, backward):
    calls = [("fwd", [("up", tuned), ("down", tuned)])]
    return calls + ([("bwd", [("dgated", tuned), ("dw", tuned)])] if backward else [])


def cpu_stream(monkeypatch):
    """The loaders' stream() asks CUDA; the CPU stand-in takes anything."""
    real = peers.load_sonicmoe

    def load(tuned=False):
        api = real(tuned)
        api.stream = lambda: 0
        return api
    monkeypatch.setattr(peers, "load_sonicmoe", load)
    monkeypatch.setattr(peers, "load_sonicmoe_tuned", lambda: load(True))
    monkeypatch.setitem(peers.FACTORIES, "sonicmoe", lambda: peers.SonicMoEPeer(loader=load))
    monkeypatch.setitem(peers.FACTORIES, "sonicmoe-tuned", lambda: peers.SonicMoETunedPeer(loader=lambda: load(True)))


@pytest.mark.parametrize("order", [("sonicmoe", "sonicmoe-tuned"), ("sonicmoe-tuned", "sonicmoe")])
def test_each_variant_runs_its_own_gemms_forward_and_backward(monkeypatch, order):
    log = fake_quack_and_sonic(monkeypatch)
    cpu_stream(monkeypatch)
    loaded = [peers.FACTORIES[name]() for name in order]  # the last one loaded leaves its binding in the modules
    assert [p.missing for p in loaded] == [None, None]
    case = workloads.make_case("tiny", TINY, "balanced", "cpu", seed=2)
    variants = {p.name: p.for_case(case) for p in loaded}
    assert {v.name for v in variants.values()} == {"sonicmoe", "sonicmoe-tuned"}
    tokens, experts = torch.arange(0, TINY[0], 5), [0, 3]
    # alternate the variants, each step (and the check's path_outputs) run to its end, as the bench does
    for name in ["sonicmoe", "sonicmoe-tuned", "sonicmoe-tuned", "sonicmoe", "sonicmoe-tuned", "sonicmoe"]:
        tuned = name == "sonicmoe-tuned"
        for p in ("fwd", "fwdbwd"):
            log.clear()
            out = variants[name].step(case, p)()
            assert log == expect(tuned, p == "fwdbwd"), (name, p)
            if p == "fwdbwd":
                assert len(out) == 4 and out[0].shape == case.x.shape
        log.clear()
        path_outputs(variants[name], case, tokens, experts, True)
        assert log == expect(tuned, True), name
    # a simulated capture (HostTimer: the step re-run) and its replays
    for name in ("sonicmoe", "sonicmoe-tuned", "sonicmoe"):
        log.clear()
        replay, _ = timing.HostTimer().capture(variants[name].step(case, "fwdbwd"), warmup=1)
        replay()
        assert log == expect(name == "sonicmoe-tuned", True) * 3, name


def test_binding_is_what_each_module_imported(monkeypatch):
    fake_quack_and_sonic(monkeypatch)
    default, tuned = peers.load_sonicmoe(), peers.load_sonicmoe(tuned=True)
    gi, fwd = sys.modules["quack.gemm_interface"], sys.modules["sonicmoe.functional.forward"]
    want = ["sonicmoe.functional.forward.gemm", "sonicmoe.functional.forward.gemm_gated",
            "sonicmoe.functional.backward.gemm", "sonicmoe.functional.backward.gemm_dgated"]
    assert sorted(default.bind.names()) == sorted(tuned.bind.names()) == sorted(want)
    assert fwd.gemm is gi.gemm  # the tuned one was loaded last: QuACK's own functions
    default.bind()
    assert fwd.gemm.func is gi.gemm and fwd.gemm.keywords == {"tuned": False}
    assert fwd.gemm("x") == ("x", False) and fwd.gemm("x", tuned=True) == ("x", True)  # a caller's tuned= wins
    tuned.bind()
    assert fwd.gemm is gi.gemm and fwd.gemm_gated is gi.gemm_gated
    assert gi.gemm("x") == ("x", True)  # quack's own names are never touched


def test_tuned_peer_about_and_missing(monkeypatch):
    fake_quack_and_sonic(monkeypatch)
    monkeypatch.setenv("QUACK_CACHE_DIR", "/carried/quack-cache")
    peer = peers.SonicMoETunedPeer()
    assert peer.missing is None and peer.name == "sonicmoe-tuned"
    assert "tuned=True" in peer.about and "QUACK_CACHE_DIR=/carried/quack-cache" in peer.about
    assert "tuned=False" in peers.SonicMoEPeer().about
    monkeypatch.delenv("QUACK_CACHE_DIR")
    assert os.path.join(".quack", "cache") in peers.SonicMoETunedPeer().about  # QuACK's default
    assert "sonicmoe-tuned" in peers.FIRST_CALL and "sonicmoe-tuned" in peers.PEERS


def test_tuned_peer_missing_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import sonicmoe raises ImportError
    peer = peers.SonicMoETunedPeer()
    assert peer.missing.startswith("not installed: ") and peer.about is None
    assert peers.describe([peer]) == {"sonicmoe-tuned": {"missing": peer.missing}}


def test_tuned_peer_refuses_what_it_cannot_bind(monkeypatch):
    fake_quack_and_sonic(monkeypatch, forward_names=("gemm",))
    with pytest.raises(peers.PeerMissing, match="autotuned GEMMs: sonicmoe.functional.forward.gemm_gated"):
        peers.load_sonicmoe(tuned=True)
    assert "sonicmoe.functional.forward.gemm_gated" in peers.SonicMoETunedPeer().missing


def test_cpu_flow_times_both_variants(monkeypatch, tmp_path, capsys):
    """bench.py --device cpu with both variants: each checked and timed, every forward's and backward's GEMMs of one
    variant (graph captures included), the speed-up over the faster one in the JSON and the tables."""
    pytest.importorskip("megamoe")
    try:
        import megamoe
        megamoe._lib.library()
    except Exception as ex:  # noqa: BLE001 - the library is not built here
        pytest.skip(f"megamoe's library cannot load: {ex}")
    import bench
    log = fake_quack_and_sonic(monkeypatch)
    cpu_stream(monkeypatch)
    monkeypatch.setitem(peers.FACTORIES, "torch_compiled", lambda: peers.TorchCompiledPeer(
        impls.CompiledTorchPath(compile_fn=lambda fn, **kw: fn)))
    rc = bench.main(["--device", "cpu", "--shapes", "tiny", "--quick", "--out", str(tmp_path), "--peers",
                     "sonicmoe,sonicmoe-tuned"])
    out = capsys.readouterr()
    assert rc == 0, out.out + out.err
    assert "check fwdbwd/sonicmoe-tuned (a peer's first call of a shape compiles its kernels, and QuACK autotunes" \
        in out.err
    (path,) = tmp_path.glob("*.json")
    results = json.loads(path.read_text())
    assert set(results["peers"]) == {"sonicmoe", "sonicmoe-tuned"}
    (case,) = results["cases"]
    for p in ("fwd", "fwdbwd"):
        assert {"sonicmoe", "sonicmoe-tuned"} <= set(case[p]) and case[p]["sonicmoe-tuned"]["graph_ms"] > 0
        versus = case["megamoe_vs_sonicmoe"][p]
        faster = min(("sonicmoe", "sonicmoe-tuned"), key=lambda n: case[p][n]["ms"])
        assert versus["against"] == faster and versus["speedup"] == pytest.approx(
            case[p][faster]["ms"] / case[p]["megamoe"]["ms"])
    # every backward ran the GEMMs of the variant whose forward it follows; both variants ran both
    flags = [(phase, {t for _, t in calls}) for phase, calls in log]
    assert all(len(f) == 1 for _, f in flags)
    last = None
    for phase, (tuned,) in flags:
        if phase == "bwd":
            assert tuned == last
        last = tuned if phase == "fwd" else last
    assert {(phase, t) for phase, (t,) in flags} == {("fwd", False), ("fwd", True), ("bwd", False), ("bwd", True)}
    assert "SonicMoE tuned" in out.out and report.VS_BEST in out.out


# ---------------------------------------------------------------------------------------------------- the report

def cell(ms, **more):
    return {"ms": ms, "peak_extra_gib": 1.0, **more}


def results_with(fwd_tuned=2.2, fwdbwd_default=9.6, peers_=None):
    """One case: the tuned variant faster in fwd (per call), the default one in fwd+bwd and in fwd's graph time."""
    case = {"shape": "toy", "routing": "balanced", "errors": {}, "grad_gib": 0.5, "flops_fwd": 1e12,
            "flops_fwdbwd": 3e12, "dense": {"ms": 1.0},
            "fwd": {"megamoe": cell(2.0, graph_ms=1.8), "sonicmoe": cell(2.4, graph_ms=2.16),
                    "sonicmoe-tuned": cell(fwd_tuned, graph_ms=2.34), "torch": cell(5.0)},
            "fwdbwd": {"megamoe": cell(8.0), "sonicmoe": cell(fwdbwd_default), "sonicmoe-tuned": cell(10.0),
                       "torch": cell(12.0)}}
    described = {"sonicmoe": {"about": "default configs (tuned=False)"},
                 "sonicmoe-tuned": {"about": "autotuned (tuned=True)"}} if peers_ is None else peers_
    return {"date": "2027-01-03", "gpu": "Test GPU", "commit": "abc1234", "command": "python3 bench/bench.py",
            "peers": described, "cases": [report.derive(case)]}


def test_speedup_is_over_the_faster_variant():
    results = results_with()
    case = results["cases"][0]
    assert case["megamoe_vs_sonicmoe"]["fwd"] == {
        "speedup": pytest.approx(1.1), "against": "sonicmoe-tuned",
        "graph_speedup": pytest.approx(1.2), "graph_against": "sonicmoe"}
    assert case["megamoe_vs_sonicmoe"]["fwdbwd"] == {"speedup": pytest.approx(1.2), "against": "sonicmoe"}
    assert report.sonicmoe_tuned_run(results)
    head = report.summary_header(results)
    assert head[3:5] == ("SonicMoE", "SonicMoE tuned") and report.VS_BEST in head
    (row,) = report.summary_rows(results)
    assert dict(zip(head, row))[report.VS_BEST] == "1.10x (tuned) / 1.20x (default)"
    assert dict(zip(head, row))["SonicMoE tuned"] == "2.20 / 10.00 (0.50)"
    (graph_row,) = report.summary_rows(results, "graph_")
    assert dict(zip(head, graph_row))[report.VS_BEST] == "1.20x (default) / —"
    # each implementation's own speed-up in the full table is unchanged
    assert case["fwd"]["sonicmoe"]["megamoe_speedup"] == pytest.approx(1.2)
    rows = {(r[2], r[3]): r for r in report.table_rows(results)}
    assert rows[("fwd", "SonicMoE tuned")][7].startswith("1.10x")
    text = report.text_table(results)
    assert "SonicMoE tuned: autotuned (tuned=True)" in text and "1.10x (tuned) / 1.20x (default)" in text
    assert "over the faster of SonicMoE's two variants" in report.markdown(results, "x.png")


def test_speedup_with_one_variant_timed():
    results = results_with(fwd_tuned=None)  # the tuned variant has no fwd time (failed its check, say)
    assert results["cases"][0]["megamoe_vs_sonicmoe"]["fwd"]["against"] == "sonicmoe"
    (row,) = report.summary_rows(results)
    assert row[report.summary_header(results).index(report.VS_BEST)] == "1.20x (default) / 1.20x (default)"
    results = results_with(peers_={"sonicmoe": {"missing": "not installed"}, "sonicmoe-tuned": {"about": "tuned"}})
    for p in ("fwd", "fwdbwd"):
        del results["cases"][0][p]["sonicmoe"]
        report.derive(results["cases"][0])
    assert results["cases"][0]["megamoe_vs_sonicmoe"]["fwdbwd"]["against"] == "sonicmoe-tuned"
    assert rr.time_rows(results)[1][rr.TIME_HEADER_TUNED.index(
        "megamoe speed-up over SonicMoE (the faster of default / tuned)")] == "1.25x (tuned)"


def test_readme_tables_with_both_variants(tmp_path):
    results = results_with()
    path = tmp_path / "2027-01-03-test-gpu-abc1234.json"
    path.write_text(json.dumps(results))
    block = rr.generate(str(path), str(tmp_path))
    header = [line for line in block.splitlines() if line.startswith("| shape | T |")][0]
    assert [c.strip() for c in header.strip("|").split(" | ")] == list(rr.TIME_HEADER_TUNED)
    rows = {(r[0], r[6]): dict(zip(rr.TIME_HEADER_TUNED, r)) for r in rr.time_rows(results)}
    speedup = "megamoe speed-up over SonicMoE (the faster of default / tuned)"
    assert rows[("toy", "fwd")][speedup] == "1.10x (tuned)" and rows[("toy", "fwd+bwd")][speedup] == "1.20x (default)"
    assert rows[("toy", "fwd")]["SonicMoE ms"] == "2.40" and rows[("toy", "fwd")]["SonicMoE tuned ms"] == "2.20"
    assert rr.memory_rows(results)[0][rr.MEMORY_HEADER_TUNED.index("SonicMoE tuned GiB")] == "0.50"
    assert "megamoe's speed-up is over the faster of the two, named in the cell" in block
    assert "SonicMoE tuned: autotuned (tuned=True)" in block


def test_results_without_the_tuned_variant_render_as_before():
    old = os.path.join(ROOT, "bench", "results", "2026-12-01-nvidia-h200-feda168.json")
    results = json.load(open(old))
    for case in results["cases"]:
        report.derive(case)
    assert not report.sonicmoe_tuned_run(results)
    assert report.summary_header(results) == report.SUMMARY_HEADER
    block = rr.generate(old, ROOT)
    assert "tuned" not in block.replace("tuned=False", "")
    times = [r for r in rr.time_rows(results)]
    assert times and all(len(r) == len(rr.TIME_HEADER) for r in times)
    index = rr.TIME_HEADER.index("megamoe speed-up over SonicMoE")
    by_case = {(c["shape"], label): c for c in results["cases"] if c.get("routing", "balanced") == "balanced"
               for p, label in report.PASSES if p in c}
    timed = 0
    for r in times:
        case = by_case[(r[0], r[6])]
        p = "fwd" if r[6] == "fwd" else "fwdbwd"
        assert r[index] == report._x(report._num(case, p, "sonicmoe", "megamoe_speedup"))  # the old definition
        timed += r[index] != "—"
    assert timed > 0
    (row, *_) = report.summary_rows(results)
    assert "(default)" not in " ".join(row)
    assert "SonicMoE tuned" not in report.peers_note(results) and "SonicMoE: sonic-moe" in report.peers_note(results)
    assert "sonicmoe-tuned" in dict(report.IMPLS) and "sonicmoe-tuned" in [s[0] for s in report.PLOT_SERIES]


# ---------------------------------------------------------------------------------------------------- the cache

def test_quack_cache_packs_and_unpacks(tmp_path):
    script = os.path.join(ROOT, "scripts", "quack_cache.sh")
    src = tmp_path / "cache"
    (src / "KEY").mkdir(parents=True)
    (src / "fingerprint").mkdir()
    (src / "KEY" / "gemm_tuned.autotune.json").write_text('{"key": ["a"], "configs_timings": []}')
    (src / "KEY" / "lock").write_text("")
    (src / "fingerprint" / "abc.o").write_bytes(os.urandom(300_000))  # does not compress
    (src / "fingerprint" / "abc.lock").write_text("")

    def sh(*args, **env):
        r = subprocess.run(["bash", script, *args], capture_output=True, text=True, env={**os.environ, **env})
        assert r.returncode == 0, r.stderr
        return r.stderr

    def listing(tar):
        return sorted(subprocess.run(["tar", "-tJf", str(tar)], capture_output=True, text=True,
                                     check=True).stdout.split())

    tar = tmp_path / "out" / "quack-cache.tar.xz"
    assert "everything" in sh("pack", str(src), str(tar))
    assert listing(tar) == ["./KEY/gemm_tuned.autotune.json", "./fingerprint/abc.o"]
    assert "autotuning results alone" in sh("pack", str(src), str(tar), QUACK_CACHE_MAX_MB="0")
    assert listing(tar) == ["./KEY/gemm_tuned.autotune.json"]
    dest = tmp_path / "next"
    (dest / "other").mkdir(parents=True)
    (dest / "other" / "kept.autotune.json").write_text("{}")
    assert "(2 autotuning results)" in sh("unpack", str(tar), str(dest))  # merged with what was there
    assert (dest / "KEY" / "gemm_tuned.autotune.json").read_text() == (src / "KEY" /
                                                                      "gemm_tuned.autotune.json").read_text()
    assert "no " in sh("unpack", str(tmp_path / "absent.tar.xz"), str(tmp_path / "fresh"))
    assert (tmp_path / "fresh").is_dir()
