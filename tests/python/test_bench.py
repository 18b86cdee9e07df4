"""The benchmark's machinery on the CPU: the three timings (fake and host timers), the graph-replay check, the
SonicMoE wrapper (layouts, gradient mapping, dropped slots) against a torch stand-in of its API, the no-autotuning
patch, the compiled torch path's fallback, the whole bench flow (`--device cpu`) with a passing and a failing peer,
and the merge of split runs."""

import argparse
import importlib.util
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
import plot  # noqa: E402
import report  # noqa: E402
import timing  # noqa: E402
import workloads  # noqa: E402
from reference import FWDBWD_KEYS, compare, path_outputs, reference_outputs  # noqa: E402
from torch_moe_baseline import moe_grouped  # noqa: E402

TINY = workloads.TEST_SHAPES["tiny"]


class FakeTimer:
    """Times from a list (cycled), capture by re-running (or raising), a fixed peak."""
    graphs = "fake"

    def __init__(self, times, capture_error=None, peak=3 * 2**30):
        self.times, self.capture_error, self.peak = list(times), capture_error, peak
        self.calls, self.windows, self.released = 0, [], 0

    def elapsed_ms(self, fn, calls=1):
        for _ in range(calls):
            fn()
        self.windows.append(calls)
        t = self.times.pop(0)
        self.times.append(t)
        return t * calls

    def capture(self, fn, warmup):
        if self.capture_error:
            raise RuntimeError(self.capture_error)
        return timing.HostTimer().capture(fn, warmup)

    def peak_extra_bytes(self, fn):
        fn()
        return self.peak

    def release(self):
        self.released += 1


def settings(**kw):
    return argparse.Namespace(**{"warmup": 2, "iters": 5, "max_seconds": 10.0, **kw})


def counter():
    calls = []

    def fn():
        calls.append(1)
        return torch.ones(3)
    return fn, calls


def test_per_call_median_and_early_stop():
    fn, calls = counter()
    r = timing.per_call(fn, FakeTimer([5.0, 1.0, 3.0, 2.0, 4.0]), warmup=2, iters=5, max_seconds=10.0)
    assert r == {"ms": 3.0, "min_ms": 1.0, "max_ms": 5.0, "iters": 5}
    assert len(calls) == 7  # 2 warm-up + 5 timed
    r = timing.per_call(fn, FakeTimer([600.0]), warmup=0, iters=20, max_seconds=1.0)
    assert r["iters"] == 3  # at least 3 runs, then stop past 1 s


def test_back_to_back_window():
    assert timing.back_to_back_calls(20, 8.0, 10.0) == 20
    assert timing.back_to_back_calls(20, 1000.0, 2.0) == 3  # capped by max_seconds, at least 3
    assert timing.back_to_back_calls(2, 1000.0, 2.0) == 2
    fn, calls = counter()
    t = FakeTimer([2.5])
    assert timing.back_to_back(fn, t, 8) == {"b2b_ms": 2.5, "b2b_calls": 8}
    assert t.windows == [8] and len(calls) == 8


def test_time_step_and_graph():
    fn, _ = counter()
    t = FakeTimer([2.0])
    r = timing.time_step(fn, t, settings())
    assert r["ms"] == r["b2b_ms"] == 2.0 and r["peak_extra_gib"] == 3.0 and r["b2b_calls"] == 5
    assert "graph_ms" not in r
    r = timing.time_step(fn, FakeTimer([2.0]), settings(), timings=("per_call",))
    assert "b2b_ms" not in r
    g = timing.time_graph(fn, t, settings())
    assert g == {"graph_ms": 2.0, "graph_min_ms": 2.0, "graph_max_ms": 2.0, "graph_iters": 5} and t.released == 1


def test_time_graph_records_a_failed_capture():
    fn, _ = counter()
    t = FakeTimer([2.0], capture_error="operation not permitted when stream is capturing")
    assert timing.time_graph(fn, t, settings()) == {
        "graph_error": "RuntimeError: operation not permitted when stream is capturing"}
    assert t.released == 1


def test_verify_replay_catches_work_left_out():
    out = torch.arange(6.0)
    timing.verify_replay(lambda: out.copy_(torch.arange(6.0)), out, lambda: torch.arange(6.0))
    with pytest.raises(RuntimeError, match="graph replay differs"):
        timing.verify_replay(lambda: None, out, lambda: torch.arange(6.0))  # the replay writes nothing
    a = torch.randn(1000)
    assert timing.rel_diff(a, a.clone()) == 0.0
    assert timing.rel_diff(a, -a, chunk=7) == pytest.approx(2.0)


def test_refuse_host_sync(monkeypatch):
    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def syncs():
        raise RuntimeError("called a synchronizing CUDA operation")
    with pytest.raises(RuntimeError, match="not captured: the step synchronizes with the host"):
        timing.refuse_host_sync(syncs)
    assert modes == ["error", 0]
    timing.refuse_host_sync(lambda: None)
    assert modes[-2:] == ["error", 0]


# ---------------------------------------------------------------------------------------------------- SonicMoE

def fake_sonic_moe(x, scores, tokens, experts, w1, b1, w2, b2, E, stream, activation, inference, layout="interleaved"):
    """moe_general_routing_inputs in plain torch, reading SonicMoE's layouts: w1 [2I, H, E] with gate / up rows
    interleaved, w2 [H, I, E]; flat slot lists sorted by token. layout='concat' misreads w1 (a wrong peer)."""
    assert w1.dim() == 3 and w1.shape[2] == E and w2.shape[2] == E and tokens.dtype == experts.dtype == torch.int32
    assert bool((tokens[1:] >= tokens[:-1]).all()) and scores.dtype == torch.float32
    W1, W2 = w1.permute(2, 0, 1).float(), w2.permute(2, 0, 1).float()  # [E, 2I, H], [E, H, I]
    I = W1.shape[1] // 2
    gate, up = (W1[:, 0::2], W1[:, 1::2]) if layout == "interleaved" else (W1[:, :I], W1[:, I:])
    e, t = experts.long(), tokens.long()
    xs = x[t].float()  # [S, H]
    a = F.silu(torch.einsum("sh,sih->si", xs, gate[e])) * torch.einsum("sh,sih->si", xs, up[e])  # [S, I]
    o = scores[:, None] * torch.einsum("si,shi->sh", a, W2[e])  # [S, H]
    y = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32).index_add(0, t, o)
    return y.to(x.dtype), torch.bincount(e, minlength=E)


def fake_api(layout="interleaved"):
    moe = (lambda *a: fake_sonic_moe(*a, layout=layout))
    return SimpleNamespace(moe=moe, swiglu="swiglu", stream=lambda: 0, about=f"fake SonicMoE ({layout})")


def test_layouts_round_trip():
    E, I, H = 3, 4, 5
    w13 = torch.randn(E, 2 * I, H)
    w1 = peers.interleave_gate_up(w13)
    assert w1.shape == (2 * I, H, E) and w1.stride() == (H, 1, 2 * I * H)  # stride order (2, 0, 1)
    assert torch.equal(w1[0::2].permute(2, 0, 1), w13[:, :I]) and torch.equal(w1[1::2].permute(2, 0, 1), w13[:, I:])
    assert torch.equal(peers.deinterleave_gate_up(w1, [2, 0]), w13[[2, 0]])


def test_flat_routing_drops_slots():
    ids = torch.tensor([[2, 0], [-1, 1], [1, -1]])
    tokens, experts, slots = peers.flat_routing(ids)
    assert tokens.tolist() == [0, 0, 1, 2] and experts.tolist() == [2, 0, 1, 1] and slots.tolist() == [0, 1, 3, 4]
    tokens, experts, slots = peers.flat_routing(ids.clamp(min=0))
    assert tokens.tolist() == [0, 0, 1, 1, 2, 2] and slots is None and experts.dtype == torch.int32


@pytest.mark.parametrize("dropped", [False, True])
def test_sonicmoe_wrapper_matches_the_reference(dropped):
    case = workloads.make_case("tiny", TINY, "balanced", "cpu", seed=1)
    if dropped:
        case.ids[::5, 1] = -1
    sonic = peers.SonicMoE(fake_api(), case)
    tokens, experts = torch.arange(0, TINY[0], 3), [0, 3, 7]
    ref = reference_outputs(case, tokens, experts, torch.float64)
    floor = reference_outputs(case, tokens, experts, torch.bfloat16)
    errs = compare(path_outputs(sonic, case, tokens, experts, True), floor, ref, label="sonicmoe")
    assert set(errs) == set(FWDBWD_KEYS)
    assert all(v["pass"] and v["sonicmoe"] < 1e-2 for v in errs.values()), errs
    assert sonic.w1_sonic.grad is None and case.w13.grad is None  # path_outputs clears the peer's leaves
    grads = sonic.step(case, "fwdbwd")()
    assert [g.shape for g in grads] == [case.x.shape, case.s.shape, (2 * TINY[2], TINY[1], TINY[3]),
                                        (TINY[1], TINY[2], TINY[3])]
    if dropped:
        assert bool((grads[1][::5, 1] == 0).all())  # dropped slots get a zero d topk_weights
    y = sonic.step(case, "fwd")()
    assert not y.requires_grad and y.shape == case.x.shape
    with pytest.raises(ValueError, match="another case"):
        sonic.fn(case.x, case.ids, case.s, case.w13.detach(), case.w2)
    sonic.close()
    assert sonic.w1_sonic is None


def test_sonicmoe_glue_on_cpu():
    """Where sonicmoe imports (not in CI): its own Python glue through our wrapper (sonicmoe_on_cpu.py)."""
    if importlib.util.find_spec("sonicmoe") is None:
        pytest.skip("sonicmoe is not installed (../shared/tools/peers/pack_sonicmoe.sh)")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sonicmoe_on_cpu.py")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    r = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "SonicMoE glue on the CPU: ok" in r.stdout, r.stdout + r.stderr[-3000:]


def fake_quack_and_sonic(monkeypatch, forward_names=("gemm", "gemm_gated")):
    """Stand-ins for quack.gemm_interface and sonicmoe's modules in sys.modules; returns (gemm_interface, forward,
    backward)."""
    def gemm_fn(name):
        def fn(*args, tuned=True, **kw):
            return name, tuned
        return fn
    gi = types.ModuleType("quack.gemm_interface")
    for n in peers.QUACK_GEMMS:
        setattr(gi, n, gemm_fn(n))
    fwd, bwd = types.ModuleType("sonicmoe.functional.forward"), types.ModuleType("sonicmoe.functional.backward")
    for n in forward_names:
        setattr(fwd, n, getattr(gi, n))
    bwd.gemm, bwd.gemm_dgated, bwd.other = gi.gemm, gi.gemm_dgated, "not a gemm"
    top = types.ModuleType("sonicmoe")
    top.moe_general_routing_inputs = fake_sonic_moe
    enums = types.ModuleType("sonicmoe.enums")
    enums.ActivationType = SimpleNamespace(SWIGLU="swiglu")
    quack = types.ModuleType("quack")
    quack.gemm_interface = gi
    for name, mod in {"quack": quack, "quack.gemm_interface": gi, "sonicmoe": top, "sonicmoe.enums": enums,
                      "sonicmoe.functional.forward": fwd, "sonicmoe.functional.backward": bwd}.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return gi, fwd, bwd


def test_load_sonicmoe_switches_off_autotuning(monkeypatch):
    gi, fwd, bwd = fake_quack_and_sonic(monkeypatch)
    api = peers.load_sonicmoe()
    assert fwd.gemm(1, 2) == ("gemm", False) and fwd.gemm_gated() == ("gemm_gated", False)
    assert bwd.gemm() == ("gemm", False) and bwd.gemm_dgated(tuned=True) == ("gemm_dgated", True)  # caller wins
    assert gi.gemm() == ("gemm", True)  # quack's own names stay as they are
    assert api.moe is fake_sonic_moe and api.swiglu == "swiglu" and "tuned=False" in api.about


def test_load_sonicmoe_refuses_what_it_cannot_patch(monkeypatch):
    fake_quack_and_sonic(monkeypatch, forward_names=("gemm",))
    with pytest.raises(peers.PeerMissing, match="sonicmoe.functional.forward.gemm_gated"):
        peers.load_sonicmoe()


def test_sonicmoe_missing_says_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "sonicmoe", None)  # import sonicmoe raises ImportError
    peer = peers.SonicMoEPeer()
    assert peer.missing.startswith("not installed: ") and peer.about is None
    assert peers.describe([peer]) == {"sonicmoe": {"missing": peer.missing}}


def test_compiled_path_falls_back_without_fullgraph():
    compiled = []

    def fake_compile(fn, fullgraph, dynamic):
        compiled.append((fullgraph, dynamic))
        if fullgraph:
            def broken(*a):
                raise RuntimeError("Unsupported: dynamic shape operator aten.bincount")
            return broken
        return fn
    path = impls.CompiledTorchPath(compile_fn=fake_compile)
    case = workloads.make_case("tiny", TINY, "balanced", "cpu")
    y = path(case.x, case.ids, case.s, case.w13, case.w2)
    assert torch.equal(y, moe_grouped(case.x, case.ids, case.s, case.w13, case.w2))
    assert compiled == [(True, False), (False, False)] and "fullgraph=False" in path.about()
    assert "fullgraph=True failed: RuntimeError: Unsupported" in path.about()


def test_compiled_path_really_compiles():
    case = workloads.make_case("tiny", TINY, "balanced", "cpu")
    impl = peers.TorchCompiledPeer().for_case(case)
    with torch.no_grad():
        y, want = impl(case), moe_grouped(case.x, case.ids, case.s, case.w13, case.w2)
    assert timing.rel_diff(y, want) < 1e-2
    grads = impl.step(case, "fwdbwd")()
    assert len(grads) == 4 and grads[2].shape == case.w13.shape


# ---------------------------------------------------------------------------------------------------- the flow

def run_cpu_bench(monkeypatch, tmp_path, capsys, layout, extra=()):
    megamoe = pytest.importorskip("megamoe")
    assert megamoe
    import bench
    monkeypatch.setitem(peers.FACTORIES, "sonicmoe", lambda: peers.SonicMoEPeer(loader=lambda: fake_api(layout)))
    monkeypatch.setitem(peers.FACTORIES, "torch_compiled", lambda: peers.TorchCompiledPeer(
        impls.CompiledTorchPath(compile_fn=lambda fn, **kw: fn)))
    rc = bench.main(["--device", "cpu", "--shapes", "tiny", "--quick", "--out", str(tmp_path), *extra])
    out = capsys.readouterr()
    (path,) = tmp_path.glob("*.json")
    return rc, json.loads(path.read_text()), out, path


def test_cpu_flow_with_peers(monkeypatch, tmp_path, capsys):
    rc, results, out, path = run_cpu_bench(monkeypatch, tmp_path, capsys, "interleaved")
    assert rc == 0, out.out + out.err
    (case,) = results["cases"]
    assert results["peers"]["sonicmoe"] == {"about": "fake SonicMoE (interleaved)"}
    assert results["settings"]["passes"] == ["fwd", "fwdbwd"] and results["graphs"] == timing.HostTimer.graphs
    for p in ("fwd", "fwdbwd"):
        names = ["megamoe", "sonicmoe", "torch_compiled", "torch"] + (["megamoe_recompute"] if p == "fwdbwd" else [])
        assert sorted(case[p]) == sorted(names)
        for name in names:
            cell = case[p][name]
            assert cell["ms"] > 0 and cell["b2b_ms"] > 0 and cell["graph_ms"] > 0 and "graph_error" not in cell
            assert (cell.get("megamoe_speedup") is None) == (name == "megamoe")
        assert all(v["pass"] for v in case["check"]["impls"]["sonicmoe"][p].values())
    assert "tiny / balanced:" in out.err and "s wall" in out.err
    assert os.path.exists(str(path)[:-5] + ".md")
    rows = {r[3]: r for r in report.table_rows(results) if r[2] == "fwd+bwd"}
    assert rows["SonicMoE"][-1] == "ok" and rows["megamoe recompute"][-1] == "ok"


def test_cpu_flow_failing_peer_is_not_timed(monkeypatch, tmp_path, capsys):
    rc, results, out, _ = run_cpu_bench(monkeypatch, tmp_path, capsys, "concat", ["--passes", "fwd", "--timings",
                                                                                 "per_call"])
    assert rc == 0, out.out + out.err  # a failing peer fails nothing
    (case,) = results["cases"]
    assert "sonicmoe" not in case["fwd"] and "fwdbwd" not in case and "b2b_ms" not in case["fwd"]["megamoe"]
    assert not case["check"]["impls"]["sonicmoe"]["fwd"]["y"]["pass"]
    assert "FAIL: sonicmoe tiny/balanced fwd y" in out.err
    rows = {r[3]: r for r in report.table_rows(results)}
    assert rows["SonicMoE"][-1] == "FAIL correctness: y (not timed)" and rows["SonicMoE"][4] == "—"
    assert rows["megamoe"][-1] == "ok"


def test_cpu_flow_failing_megamoe_fails_the_run(monkeypatch, tmp_path, capsys):
    wrong = impls.Impl("megamoe_recompute", lambda *a: 1.5 * moe_grouped(*a), passes=("fwdbwd",))
    monkeypatch.setattr(impls, "megamoe_impls", lambda megamoe: [impls.Impl("megamoe", moe_grouped), wrong])
    rc, results, out, _ = run_cpu_bench(monkeypatch, tmp_path, capsys, "interleaved", ["--timings", "per_call"])
    assert rc == 1 and "FAILED: tiny/balanced" in out.out
    (case,) = results["cases"]
    assert "fwd" not in case and "fwdbwd" not in case and "dense" not in case  # nothing timed
    assert not case["check"]["impls"]["megamoe_recompute"]["fwdbwd"]["y"]["pass"]
    rows = {(r[2], r[3]): r for r in report.table_rows(results)}
    assert rows[("fwd+bwd", "megamoe recompute")][-1].startswith("FAIL correctness: y, dx")
    assert rows[("fwd", "megamoe")][-1] == "not timed" and rows[("fwd", "SonicMoE")][-1] == "not timed"


def test_cpu_flow_stop_after(monkeypatch, tmp_path, capsys):
    rc, results, out, path = run_cpu_bench(monkeypatch, tmp_path, capsys, "interleaved",
                                           ["--stop-after", "0", "--routing", "balanced,skewed", "--no-peers",
                                            "--passes", "fwd", "--timings", "per_call"])
    assert rc == 0 and [c["routing"] for c in results["cases"]] == ["balanced"]
    assert results["skipped"] == ["tiny/skewed"] and "skipped (--stop-after): tiny/skewed" in out.out
    assert results["peers"] == {} and sorted(results["cases"][0]["fwd"]) == ["megamoe", "torch"]
    assert "skipped (--stop-after): tiny/skewed" in open(str(path)[:-5] + ".md").read()


def test_cpu_demo_without_a_gpu(capsys):
    pytest.importorskip("megamoe")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: bench.py runs the benchmark, not the demo")
    import bench
    assert bench.main([]) == 0
    out = capsys.readouterr().out
    assert "CPU demo passed" in out
    next_steps = out[out.index("CPU demo passed"):]  # what to run next, after the verdict
    assert "python bench/bench.py --device cpu --shapes tiny" in next_steps and "python.md" in next_steps


def test_merge_split_runs(tmp_path):
    def run(shape, command, peers_info):
        return {"date": "2027-01-02", "gpu": "G", "commit": "abc1234", "command": command, "peers": peers_info,
                "cases": [{"shape": shape, "routing": "balanced", "errors": {}}]}
    a = run("s1", "bench --shapes s1", {"sonicmoe": {"missing": "not installed"}})
    b = run("s2", "bench --shapes s2", {"sonicmoe": {"about": "sonic"}, "torch_compiled": {"about": "tc"}})
    merged = plot.merge([a, b])
    assert [c["shape"] for c in merged["cases"]] == ["s1", "s2"]
    assert merged["command"] == "bench --shapes s1 ; bench --shapes s2"
    assert merged["peers"] == {"sonicmoe": {"about": "sonic"}, "torch_compiled": {"about": "tc"}}
    with pytest.raises(ValueError, match="different commits"):
        plot.merge([a, dict(b, commit="fffffff")])
    paths = []
    for i, r in enumerate((a, b)):
        paths.append(str(tmp_path / f"r{i}.json"))
        with open(paths[-1], "w") as f:
            json.dump(r, f)
    plot.main(["--merge", str(tmp_path / "m.json")] + paths)
    assert [c["shape"] for c in json.loads((tmp_path / "m.json").read_text())["cases"]] == ["s1", "s2"]
    assert (tmp_path / "m.md").exists()
