"""Benchmark results: derived numbers, the tables (text and markdown), the PNG plot, and the files in bench/results/.

Everything here works from the results dict alone (the JSON written by bench.py), so plot.py can re-render it; JSONs
written before the peers, the three timings and FP8 render too (their missing numbers print as "—").
"""
import json
import math
import os
import re
import sys

PASSES = (("fwd", "fwd"), ("fwdbwd", "fwd+bwd"))
IMPLS = (("megamoe", "megamoe"), ("megamoe_recompute", "megamoe recompute"), ("megamoe-fp8", "megamoe FP8"),
         ("megamoe-fp8+wq", "megamoe FP8 + weight quant."), ("sonicmoe", "SonicMoE"),
         ("sonicmoe-tuned", "SonicMoE tuned"), ("torchao-fp8", "torchao FP8"), ("torch_compiled", "torch compiled"),
         ("torch", "torch eager"))
# the bf16 peers (peers_note; SonicMoE tuned only where the run describes it: runs before it lack it)
PEERS = {"sonicmoe": "SonicMoE", "sonicmoe-tuned": "SonicMoE tuned", "torch_compiled": "torch compiled"}
# SonicMoE's two variants: QuACK's default GEMM configs and its autotuned ones. megamoe's speed-up over SonicMoE is
# over the faster of those timed (per pass and timing), named by these words where the run had sonicmoe-tuned.
SONIC = {"sonicmoe": "default", "sonicmoe-tuned": "tuned"}
# The FP8 implementations (fp8_rows, fp8_note): megamoe's FP8 variants (described in results["fp8"]) and torchao's
# (a peer, in results["peers"]).
FP8 = {"megamoe-fp8": "megamoe FP8", "megamoe-fp8+wq": "megamoe FP8 + weight quant.", "torchao-fp8": "torchao FP8"}
MODES = (("", "per call"), ("b2b_", "back to back"), ("graph_", "CUDA graph"))  # key prefix: ms, b2b_ms, graph_ms
HEADER = ("shape", "routing", "pass", "implementation", "ms per call / b2b / graph", "TFLOP/s", "% dense",
          "megamoe speed-up", "extra peak GiB", "activation GiB", "max rel err", "status")


def _num(d, *keys):
    """d[k0][k1]... or None when missing or not a finite number."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d if isinstance(d, (int, float)) and not isinstance(d, bool) and math.isfinite(d) else None


def _cells(case, p):
    """{implementation: its timing dict} of one pass (old JSONs also keep pass-level numbers there: skipped)."""
    cells = case.get(p)
    return {k: v for k, v in cells.items() if isinstance(v, dict)} if isinstance(cells, dict) else {}


def _ratio(a, b, scale=1.0):
    return scale * a / b if a and b else None


def faster_sonicmoe(case, p, prefix=""):
    """(name, ms) of the faster of SonicMoE's variants (SONIC) timed in pass p and timing `prefix`, or (None, None)."""
    timed = [(ms, name) for name in SONIC for ms in [_num(case, p, name, prefix + "ms")] if ms]
    if not timed:
        return None, None
    ms, name = min(timed)
    return name, ms


def speedup_over_sonicmoe(case, p, prefix=""):
    """(megamoe's speed-up over the faster SonicMoE variant: its ms / megamoe's, that variant's name), or (None,
    None)."""
    name, ms = faster_sonicmoe(case, p, prefix)
    speedup = _ratio(ms, _num(case, p, "megamoe", prefix + "ms"))
    return (speedup, name) if speedup is not None else (None, None)


def derive(case):
    """Adds, in place, to each timed cell: TFLOP/s and % of the dense GEMM's rate per timing, megamoe's speed-up over
    it per timing (its ms / megamoe's ms) and its activation GiB (extra peak minus the gradient outputs' bytes); and
    to the case, per pass, megamoe's speed-up over the faster SonicMoE variant per timing and which one that was
    (case["megamoe_vs_sonicmoe"][pass]: speedup, against; b2b_ and graph_ ones likewise)."""
    flop = {"fwd": _num(case, "flops_fwd"), "fwdbwd": _num(case, "flops_fwdbwd")}
    dense = case.get("dense") if isinstance(case.get("dense"), dict) else {}
    for prefix, _ in MODES:
        if _num(dense, prefix + "ms") and flop["fwd"]:
            dense[prefix + "tflops"] = flop["fwd"] / dense[prefix + "ms"] / 1e9
    for p, _ in PASSES:
        cells = _cells(case, p)
        grads = _num(case, "grad_gib") if p == "fwdbwd" else 0.0
        for name, cell in cells.items():
            for prefix, _ in MODES:
                ms = _num(cell, prefix + "ms")
                if ms and flop[p]:
                    cell[prefix + "tflops"] = flop[p] / ms / 1e9
                tf = _num(cell, prefix + "tflops")
                cell[prefix + "pct_dense"] = _ratio(tf, _num(dense, prefix + "tflops"), 100.0)
                if name != "megamoe":
                    cell[prefix + "megamoe_speedup"] = _ratio(ms, _num(cells, "megamoe", prefix + "ms"))
            peak = _num(cell, "peak_extra_gib")
            cell["activation_gib"] = None if peak is None or grads is None else peak - grads
        versus = {}
        for prefix, _ in MODES:
            speedup, name = speedup_over_sonicmoe(case, p, prefix)
            if speedup is not None:
                versus.update({prefix + "speedup": speedup, prefix + "against": name})
        if versus:
            case.setdefault("megamoe_vs_sonicmoe", {})[p] = versus
        elif isinstance(case.get("megamoe_vs_sonicmoe"), dict):
            case["megamoe_vs_sonicmoe"].pop(p, None)
    return case


def _f(v, spec):
    return "—" if v is None else format(v, spec)


def _x(v):
    return "—" if v is None else f"{v:.2f}x"


def _triple(cell, key, fmt):
    """'a / b / c' of one quantity per timing; '—' when none is there."""
    vals = [fmt(_num(cell, prefix + key)) for prefix, _ in MODES]
    return "—" if all(v == "—" for v in vals) else " / ".join(vals)


def _stages_of(name, p):
    """The stage names (bench.py) whose errors belong to one implementation's row in pass p; the case-wide ones
    (check, run) go to megamoe's rows."""
    own = {f"{p}/{name}", f"build/{name}", f"check/{p}/{name}"}
    return own | ({"check", "run"} if name == "megamoe" else {"dense"} if name == "dense" else set())


def _errors_of(case, name, p):
    own = _stages_of(name, p)
    return [f"{stage}: {msg}" for key in ("errors", "peer_errors") for stage, msg in case.get(key, {}).items()
            if stage in own]


def _check_of(case, name, p):
    check = case.get("check", {})
    return check.get(p, {}) if name == "megamoe" else check.get("impls", {}).get(name, {}).get(p, {})


def _described(results, name):
    """{"about": ...} or {"missing": ...} of an implementation the run may lack (a peer, an FP8 variant), or None."""
    return results.get("peers", {}).get(name) or results.get("fp8", {}).get(name)


def _status(results, case, name, p, cell):
    """'ok', or what is wrong with one implementation in one pass: missing, correctness, errors, graph capture;
    'not timed' where nothing else says why it has no time."""
    missing = (_described(results, name) or {}).get("missing")
    if missing:
        return f"missing: {missing}"
    msgs = []
    bad = [k for k, v in _check_of(case, name, p).items() if not v.get("pass", True)]
    if bad:
        msgs.append("FAIL correctness: " + ", ".join(bad) + ("" if name == "megamoe" else " (not timed)"))
    if name == "megamoe" and case.get("check", {}).get("bitwise_repeatable", {}).get(p) is False:
        msgs.append("megamoe not bitwise repeatable")
    msgs += _errors_of(case, name, p)
    if cell.get("graph_error"):
        msgs.append(f"graph: {cell['graph_error']}")
    return "; ".join(msgs) or ("ok" if _num(cell, "ms") is not None else "not timed")


def _max_err(case, name, p):
    who = "torch_bf16" if name == "torch" else name
    errs = [v.get(who) for v in _check_of(case, "megamoe" if name == "torch" else name, p).values()]
    errs = [e for e in errs if isinstance(e, (int, float))]
    if not errs:
        return None
    return max(errs, key=lambda e: e if math.isfinite(e) else math.inf)


def _shown(results, case, p):
    """The implementations with a row in pass p: timed, checked, errored or missing."""
    names = [n for n, _ in IMPLS if n in _cells(case, p) or _check_of(case, n, p) or _errors_of(case, n, p)
             or _described(results, n)]
    return [n for n in names if n != "megamoe_recompute" or p == "fwdbwd"]


def _dense_cell(case, p):
    """The dense GEMM's numbers as the ceiling of pass p: its ms per timing 3x for fwd+bwd, its rates as measured."""
    dense = case.get("dense") if isinstance(case.get("dense"), dict) else {}
    scale = 3 if p == "fwdbwd" else 1
    return {k: v * scale if k.endswith("ms") and _num(dense, k) is not None else v for k, v in dense.items()}


def _ms(v):
    return _f(v, ".2f")


def _rate(v):
    return _f(v, ".0f")


def table_rows(results):
    """One row per case, pass and implementation, then the dense GEMM."""
    rows = []
    for case in results["cases"]:
        passes = [(p, label) for p, label in PASSES if p in case or p in case.get("check", {})]
        for p, label in passes or [("", "—")]:
            cells = _cells(case, p)
            for name in _shown(results, case, p):
                cell = cells.get(name, {})
                rows.append([case["shape"], case["routing"], label, dict(IMPLS)[name], _triple(cell, "ms", _ms),
                             _triple(cell, "tflops", _rate), _triple(cell, "pct_dense", _rate),
                             _triple(cell, "megamoe_speedup", _x), _f(_num(cell, "peak_extra_gib"), ".2f"),
                             _f(_num(cell, "activation_gib"), ".2f"), _f(_max_err(case, name, p), ".1e"),
                             _status(results, case, name, p, cell)])
            if "dense" in case:
                dense = _dense_cell(case, p)
                rows.append([case["shape"], case["routing"], label, "dense bf16 GEMM", _triple(dense, "ms", _ms),
                             _triple(dense, "tflops", _rate), "—", "—", "—", "—", "—",
                             _status(results, case, "dense", p, dense)])
    return rows


SUMMARY_HEADER = ("shape", "megamoe ms fwd / fwd+bwd (activation GiB)", "megamoe recompute fwd+bwd ms (GiB)",
                  "SonicMoE", "torch compiled", "torch eager", "dense GEMM fwd ms", "megamoe vs SonicMoE fwd / fwd+bwd",
                  "megamoe TFLOP/s fwd / fwd+bwd (% dense)")
VS_BEST = "megamoe vs SonicMoE (the faster of default / tuned) fwd / fwd+bwd"


def sonicmoe_tuned_run(results):
    """Whether the run had SonicMoE's autotuned variant (described, timed, checked or errored): its tables then show
    both variants and name the one each speed-up is against."""
    return "sonicmoe-tuned" in results.get("peers", {}) or any(
        "sonicmoe-tuned" in _cells(case, p) or _check_of(case, "sonicmoe-tuned", p)
        or _errors_of(case, "sonicmoe-tuned", p) for case in results["cases"] for p, _ in PASSES)


def summary_header(results):
    """SUMMARY_HEADER, with a SonicMoE tuned column and VS_BEST where the run had sonicmoe-tuned."""
    if not sonicmoe_tuned_run(results):
        return SUMMARY_HEADER
    head = list(SUMMARY_HEADER)
    head[head.index("SonicMoE"):head.index("SonicMoE") + 1] = ["SonicMoE", "SonicMoE tuned"]
    head[head.index("megamoe vs SonicMoE fwd / fwd+bwd")] = VS_BEST
    return tuple(head)


def vs_sonicmoe(case, p, prefix="", named=True):
    """'1.02x (tuned)': megamoe's speed-up over the faster SonicMoE variant, named (named=False: the number alone)."""
    speedup, name = speedup_over_sonicmoe(case, p, prefix)
    return _x(speedup) + (f" ({SONIC[name]})" if named and name else "")


def _ms_cell(case, name, prefix, passes=("fwd", "fwdbwd")):
    """'fwd / fwd+bwd (activation GiB)' of one implementation; '—' when it has no time."""
    ms = [_ms(_num(case, p, name, prefix + "ms")) for p in passes]
    if all(v == "—" for v in ms):
        return "—"
    act = _num(case, "fwdbwd", name, "activation_gib")
    return " / ".join(ms) + ("" if act is None else f" ({act:.2f})")


def _pair(vals, fmt):
    out = [fmt(v) for v in vals]
    return "—" if all(v == "—" for v in out) else " / ".join(out)


def summary_rows(results, prefix="", routing=None):
    """One row per case (of `routing`, or all, labelled 'shape (routing)' when they differ), the columns of
    summary_header(results): each implementation's ms fwd / fwd+bwd with its activation GiB, megamoe's speed-up over
    SonicMoE (over the faster of its default and tuned variants, named, where the run had the tuned one) and its
    TFLOP/s, in one timing (the cases derive()d)."""
    cases = [c for c in results["cases"] if routing is None or c.get("routing") == routing]
    label_routing = len({c.get("routing") for c in cases}) > 1
    tuned = sonicmoe_tuned_run(results)
    rows = []
    for case in cases:
        speedups = [vs_sonicmoe(case, p, prefix, named=tuned) for p, _ in PASSES]
        tflops = [_num(case, p, "megamoe", prefix + "tflops") for p, _ in PASSES]
        pcts = [_num(case, p, "megamoe", prefix + "pct_dense") for p, _ in PASSES]
        rate = _pair(tflops, _rate)
        if rate != "—" and any(pcts):
            rate += " (" + " / ".join(_f(v, ".0f") + ("%" if v is not None else "") for v in pcts) + ")"
        rows.append([case["shape"] + (f" ({case['routing']})" if label_routing else ""),
                     _ms_cell(case, "megamoe", prefix), _ms_cell(case, "megamoe_recompute", prefix, ("fwdbwd",)),
                     _ms_cell(case, "sonicmoe", prefix),
                     *([_ms_cell(case, "sonicmoe-tuned", prefix)] if tuned else []),
                     _ms_cell(case, "torch_compiled", prefix), _ms_cell(case, "torch", prefix),
                     _ms(_num(case, "dense", prefix + "ms")),
                     "—" if all(v == "—" for v in speedups) else " / ".join(speedups), rate])
    return rows


def peers_note(results):
    """What the peers were in this run, or why one is missing."""
    if "peers" not in results:
        return "SonicMoE and the compiled torch path: not measured (the run predates them)."
    parts = []
    for name, label in PEERS.items():
        info = results["peers"].get(name)
        if info is None and name == "sonicmoe-tuned":
            continue  # a run before it, or without it: nothing to say
        parts.append(f"{label}: " + ("not run (--peers)" if info is None else
                                     f"missing ({info['missing']})" if "missing" in info else info["about"]))
    return "; ".join(parts) + "."


FP8_HEADER = ("shape", "implementation", "ms fwd / fwd+bwd", "speed-up over megamoe bf16 fwd / fwd+bwd",
              "activation GiB", "max rel err vs fp32 fwd / fwd+bwd")
FP8_ROWS = (("megamoe", "megamoe bf16"), *FP8.items(), ("sonicmoe", "SonicMoE (bf16)"),
            ("sonicmoe-tuned", "SonicMoE tuned (bf16)"))


def fp8_measured(results):
    """Whether any case has a time, a check or an error of an FP8 implementation."""
    return any(name in _cells(case, p) or _check_of(case, name, p) or _errors_of(case, name, p)
               for case in results["cases"] for p, _ in PASSES for name in FP8)


def fp8_rows(results, prefix="", routing=None):
    """The FP8 implementations beside megamoe bf16 and SonicMoE, one row per case (of `routing`, or all) and
    implementation with anything measured: ms fwd / fwd+bwd in one timing, the speed-up over megamoe bf16 (megamoe's
    ms / its ms), activation GiB, the largest relative error against the fp32 reference per pass (the cases
    derive()d)."""
    cases = [c for c in results["cases"] if routing is None or c.get("routing") == routing]
    label_routing = len({c.get("routing") for c in cases}) > 1
    rows = []
    for case in cases:
        for name, label in FP8_ROWS:
            errs = [_max_err(case, name, p) for p, _ in PASSES]
            ms = [_num(case, p, name, prefix + "ms") for p, _ in PASSES]
            if all(v is None for v in ms + errs):
                continue
            speedups = [_ratio(_num(case, p, "megamoe", prefix + "ms"), v) for (p, _), v in zip(PASSES, ms)]
            rows.append([case["shape"] + (f" ({case['routing']})" if label_routing else ""), label, _pair(ms, _ms),
                         _pair(speedups, _x), _f(_num(case, "fwdbwd", name, "activation_gib"), ".2f"),
                         _pair(errs, lambda v: _f(v, ".1e"))])
    return rows


def fp8_note(results):
    """What the FP8 implementations were in this run, or why one is missing; '' for a run that predates them."""
    if "fp8" not in results and "torchao-fp8" not in results.get("peers", {}):
        return ""
    parts = []
    for name, label in FP8.items():
        info = _described(results, name)
        parts.append(f"{label}: " + ("not run (" + ("--peers" if name == "torchao-fp8" else "--no-fp8") + ")"
                                     if info is None else f"missing ({info['missing']})" if "missing" in info
                                     else info["about"]))
    tolerance = _num(results, "settings", "fp8_tolerance")
    return ("FP8, each checked against the fp32 reference within a relative error of"
            f" {_f(tolerance, 'g')} instead of the bf16 rule: " + "; ".join(parts) + ".")


def markdown_rows(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in rows]


def _text_rows(header, rows):
    rows = [list(header)] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return lines


def text_table(results):
    """Every number, then the per-call summary (what the README shows) and the FP8 one, where FP8 was measured."""
    fp8 = ["", "FP8, per call:"] + _text_rows(FP8_HEADER, fp8_rows(results)) if fp8_measured(results) else []
    return "\n".join(_text_rows(HEADER, table_rows(results)) + ["", "per call:"]
                     + _text_rows(summary_header(results), summary_rows(results)) + [peers_note(results)] + fp8
                     + ([fp8_note(results)] if fp8_note(results) else []))


def markdown_table(results):
    return "\n".join(markdown_rows(HEADER, table_rows(results)))


def markdown(results, png_name):
    s = results.get("settings", {})
    commit = results["commit"] + (" (uncommitted changes)" if results.get("git_dirty") else "")
    summaries = []
    for prefix, label in MODES:
        rows = summary_rows(results, prefix)
        if any(c != "—" for r in rows for c in r[1:]):
            summaries += [f"## {label[0].upper() + label[1:]}", "", *markdown_rows(summary_header(results), rows), ""]
    if fp8_measured(results):
        summaries += ["## FP8 (per call)", "", *markdown_rows(FP8_HEADER, fp8_rows(results)), ""]
    return "\n".join([
        f"# megamoe benchmark: {results['gpu']}, {results['date']}",
        "",
        f"- commit `{commit}`, megamoe {results.get('megamoe_version', '—')}, torch"
        f" {results.get('torch_version', '—')} (CUDA {results.get('cuda_version', '—')})",
        f"- command: `{results.get('command', '—')}`",
        f"- peers: {peers_note(results)}",
        *([f"- {fp8_note(results)}"] if fp8_note(results) else []),
        *([f"- skipped (--stop-after): {', '.join(results['skipped'])}"] if results.get("skipped") else []),
        f"- method: CUDA events; warm-up runs: {s.get('warmup')}, then the median of up to {s.get('iters')} runs"
        f" (fewer if one number would take over {s.get('max_seconds')} s). Three timings per pass: per call (events"
        " around one call, the GPU idle before it: host work counts; `ms` in the JSON), back to back (N calls between"
        " two events, / N; N = the runs above) and CUDA-graph replay (one call captured after warm-up on a side"
        " stream, the replay checked against an eager call, then timed per call; a step that synchronizes with the"
        f" host is not captured; graphs: {results.get('graphs', '—')}). fwd = forward under torch.no_grad();"
        " fwd+bwd = forward + torch.autograd.grad(y, (x, topk_weights, w13, w2), dy) (nothing accumulates into"
        " .grad, so the same step replays). One input set per shape (working set above the 60 MB L2, so no"
        " rotation). Correctness checked before timing, for every implementation: relative Frobenius error against"
        f" an fp32 reference of DESIGN §1 on {s.get('check_tokens')} random tokens (y, dx, d topk_weights) and up to"
        " 4 experts (dw13, dw2); each must be within 5x the bf16 eager torch path's error + 1e-3. A peer that fails"
        " is reported and not timed.",
        "- FLOPs: fwd 6·T·topk·H·I, fwd+bwd 18·T·topk·H·I. torch eager / compiled = `moe_grouped` of"
        " torch_moe_baseline.py (argsort + `torch._grouped_mm` + autograd), without / with torch.compile. Dense"
        " ceiling = bf16 GEMM [T·topk, H] x [H, 3I] of the forward's FLOPs in the same run, in each timing; the"
        " fwd+bwd ceiling ms is 3x its time; % dense compares rates within one timing. megamoe speed-up = that"
        " implementation's ms / megamoe's ms." + (" megamoe vs SonicMoE: over the faster of SonicMoE's two variants"
        " in that pass and timing, named in the cell: default = QuACK's default GEMM configs (`sonicmoe`), tuned ="
        " its autotuned ones (`sonicmoe-tuned`, SonicMoE's own default; autotuned before timing)."
        if sonicmoe_tuned_run(results) else ""),
        "- megamoe runs fwd+bwd in its default memory mode (keep h = [g, u] from the forward); megamoe recompute is"
        " the same pass with recompute=True (only the inputs kept, h recomputed in the backward).",
        "- extra peak GiB = torch.cuda.max_memory_allocated during one pass above the allocation before it"
        " (for fwd+bwd it includes the x, topk_weights, w13, w2 gradients); activation GiB = the same minus those"
        " gradients' bytes (what each implementation adds beyond its outputs). max rel err = the largest over the"
        " checked tensors.",
        "",
        *summaries,
        "## All numbers",
        "",
        markdown_table(results),
        "",
        f"![TFLOP/s per shape]({png_name})",
        ""])


PLOT_SERIES = (("megamoe", "megamoe", "tab:green"), ("megamoe-fp8", "megamoe FP8", "tab:olive"),
               ("sonicmoe", "SonicMoE", "tab:red"), ("sonicmoe-tuned", "SonicMoE tuned", "tab:pink"),
               ("torchao-fp8", "torchao FP8", "tab:purple"),
               ("torch_compiled", "torch compiled", "tab:orange"), ("torch", "torch eager", "tab:blue"),
               ("dense", "dense bf16 GEMM (ceiling)", "tab:gray"))


def plot(results, path):
    """Grouped bars of per-call TFLOP/s per case for each implementation measured: fwd above, fwd+bwd below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    multi_routing = len({c["routing"] for c in cases}) > 1
    labels = [c["shape"] + (f"\n{c['routing']}" if multi_routing else "") for c in cases]

    def values(key, p):
        return [_num(c, "dense", "tflops") if key == "dense" else _num(c, p, key, "tflops") for c in cases]

    series = [s for s in PLOT_SERIES if any(v is not None for p, _ in PASSES for v in values(s[0], p))]
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.5 * len(series) * len(cases) + 3), 8), sharey=True)
    width = 0.8 / max(1, len(series))
    for ax, (p, title) in zip(axes, PASSES):
        for i, (key, name, color) in enumerate(series):
            vals = values(key, p)
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cases))]
            bars = ax.bar(xs, [v or 0 for v in vals], width, label=name, color=color)
            for b, v in zip(bars, vals):
                ax.annotate("n/a" if v is None else f"{v:.0f}", (b.get_x() + width / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_title(title + " (per call)")
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_ylabel("TFLOP/s (bf16 unless marked FP8)")
        ax.grid(axis="y", alpha=0.3)
    if series:
        axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"megamoe vs peers, {results['gpu']}, {results['date']}, commit {results['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path + ".tmp", dpi=130, format="png")
    os.replace(path + ".tmp", path)
    plt.close(fig)


def render(results, json_path):
    """Writes the .md and .png beside json_path (same base name); returns their paths (no .png without matplotlib,
    which a CPU-only test machine may lack)."""
    base = os.path.splitext(json_path)[0]
    png, md = base + ".png", base + ".md"
    _write_text(md, markdown(results, os.path.basename(png)))
    try:
        plot(results, png)
    except ImportError as ex:
        print(f"no plot: {ex}", file=sys.stderr)
        return (md,)
    return md, png


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def write_side_record(out_dir, record, kind, text):
    """A side benchmark's <out_dir>/<date>-<gpu slug>-<commit>-<kind>.json (the record, which has date, gpu, commit)
    and .md (its table text)."""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, f"{record['date']}-{slug(record['gpu'])}-{slug(record['commit'])}-{kind}")
    with open(stem + ".json", "w") as f:
        json.dump(record, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(text)


def results_path(results, out_dir):
    """<out_dir>/<date>-<gpu slug>-<commit>.json, with -2, -3... appended rather than overwriting a file."""
    base = os.path.join(out_dir, f"{results['date']}-{slug(results['gpu'])}-{slug(results['commit'])}")
    path, n = base + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}.json"
    return path


def _write_text(path, text):
    """Writes through a temporary file and a rename: a run killed mid-write leaves the previous file whole."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write(results, path):
    """Writes the JSON at path, then the markdown and the PNG beside it; returns the paths."""
    _write_text(path, json.dumps(results, indent=1))
    return (path, *render(results, path))
