"""Benchmark results: derived numbers, the table (text and markdown), the PNG plot, and the files in bench/results/.

Everything here works from the results dict alone (the JSON written by bench.py), so plot.py can re-render it.
"""
import json
import math
import os
import re

PASSES = (("fwd", "fwd"), ("fwdbwd", "fwd+bwd"))
PATHS = ("megamoe", "torch")
HEADER = ("shape", "routing", "pass", "megamoe ms", "torch ms", "ceiling ms", "megamoe TFLOP/s", "torch TFLOP/s",
          "dense TFLOP/s", "speed-up", "megamoe % dense", "torch % dense", "recompute-mode ms",
          "extra peak GiB m / m-rc / t", "activation GiB m / m-rc / t", "rel err m / t", "status")


def _num(d, *keys):
    """d[k0][k1]... or None when missing or not a finite number."""
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d if isinstance(d, (int, float)) and math.isfinite(d) else None


def derive(case):
    """Adds speed-up vs torch and % of the dense ceiling to each timed pass of a case result (in place)."""
    dense = _num(case, "dense", "tflops")
    for p, _ in PASSES:
        res = case.get(p)
        if not isinstance(res, dict):
            continue
        m, t = _num(res, "megamoe", "ms"), _num(res, "torch", "ms")
        res["speedup_vs_torch"] = t / m if m and t else None
        for path in PATHS:
            tf = _num(res, path, "tflops")
            res[f"{path}_pct_dense"] = 100.0 * tf / dense if tf and dense else None
    return case


def _f(v, spec):
    return "—" if v is None else format(v, spec)


def _status(case, p):
    """'ok', or why not: correctness failures and errors of the case and of this pass."""
    msgs = []
    check = case.get("check", {}).get(p, {})
    bad = [k for k, v in check.items() if not v.get("pass", True)]
    if bad:
        msgs.append("FAIL correctness: " + ", ".join(bad))
    if case.get("check", {}).get("bitwise_repeatable", {}).get(p) is False:
        msgs.append("megamoe not bitwise repeatable")
    for stage, msg in case.get("errors", {}).items():
        if "/" not in stage or stage.startswith(p + "/"):
            msgs.append(f"{stage}: {msg}")
    return "; ".join(msgs) or "ok"


def _max_err(case, p, who):
    errs = [v.get(who) for v in case.get("check", {}).get(p, {}).values()]
    errs = [e for e in errs if isinstance(e, (int, float))]
    if not errs:
        return None
    return max(errs, key=lambda e: e if math.isfinite(e) else math.inf)


def table_rows(results):
    rows = []
    for case in results["cases"]:
        dense_ms, dense_tf = _num(case, "dense", "ms"), _num(case, "dense", "tflops")
        shown = [(p, label) for p, label in PASSES if p in case or p in case.get("check", {})]
        for p, label in shown or [("", "—")]:
            res = case.get(p, {})
            ceiling_ms = None if dense_ms is None else dense_ms * (3 if p == "fwdbwd" else 1)
            peaks = [_num(res, path, "peak_extra_gib") for path in ("megamoe", "megamoe_recompute", "torch")]
            mem = " / ".join(_f(v, ".2f") for v in peaks)
            grads = _num(case, "grad_gib") if p == "fwdbwd" else 0.0
            activation = " / ".join(_f(None if v is None or grads is None else v - grads, ".2f") for v in peaks)
            err = f"{_f(_max_err(case, p, 'megamoe'), '.1e')} / {_f(_max_err(case, p, 'torch_bf16'), '.1e')}"
            speedup = _num(res, "speedup_vs_torch")
            rows.append([
                case["shape"], case["routing"], label,
                _f(_num(res, "megamoe", "ms"), ".2f"), _f(_num(res, "torch", "ms"), ".2f"), _f(ceiling_ms, ".2f"),
                _f(_num(res, "megamoe", "tflops"), ".0f"), _f(_num(res, "torch", "tflops"), ".0f"), _f(dense_tf, ".0f"),
                "—" if speedup is None else f"{speedup:.2f}x",
                _f(_num(res, "megamoe_pct_dense"), ".0f"), _f(_num(res, "torch_pct_dense"), ".0f"),
                _f(_num(res, "megamoe_recompute", "ms"), ".2f"), mem, activation, err, _status(case, p)])
    return rows


def text_table(results):
    rows = [list(HEADER)] + table_rows(results)
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines.insert(1, "-" * max(len(line) for line in lines))
    return "\n".join(lines)


def markdown_table(results):
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(c.replace("|", "/") for c in r) + " |" for r in table_rows(results)]
    return "\n".join(lines)


def markdown(results, png_name):
    s = results.get("settings", {})
    commit = results["commit"] + (" (uncommitted changes)" if results.get("git_dirty") else "")
    return "\n".join([
        f"# megamoe benchmark: {results['gpu']}, {results['date']}",
        "",
        f"- commit `{commit}`, megamoe {results['megamoe_version']}, torch {results['torch_version']}"
        f" (CUDA {results.get('cuda_version')})",
        f"- command: `{results['command']}`",
        f"- method: CUDA events; warm-up runs: {s.get('warmup')}, then the median of up to {s.get('iters')} runs"
        f" (fewer if one number would take over {s.get('max_seconds')} s). fwd = forward under torch.no_grad();"
        " fwd+bwd = forward + y.backward(dy), gradients reset each run. One input set per shape (working set"
        " above the 60 MB L2, so no rotation); correctness checked before timing: relative Frobenius error against an"
        f" fp32 reference of DESIGN §1 on {s.get('check_tokens')} random tokens (y, dx, d topk_weights) and up to 4"
        " experts (dw13, dw2); megamoe must be within 5x the bf16 torch path's error + 1e-3.",
        "- FLOPs: fwd 6·T·topk·H·I, fwd+bwd 18·T·topk·H·I. torch = `moe_grouped` of torch_moe_baseline.py"
        " (argsort + `torch._grouped_mm` + autograd). Dense ceiling = bf16 GEMM [T·topk, H] x [H, 3I] of the"
        " forward's FLOPs in the same run; the fwd+bwd ceiling ms is 3x its time.",
        "- megamoe runs fwd+bwd in its default memory mode (keep h = [g, u] from the forward); recompute-mode ms and"
        " m-rc are the same pass with recompute=True (only the inputs kept, h recomputed in the backward).",
        "- extra peak GiB = torch.cuda.max_memory_allocated during one pass above the allocation before it"
        " (for fwd+bwd it includes the new x, w13, w2, topk_weights gradients); activation GiB = the same minus"
        " those gradients' bytes (what each path adds beyond its outputs). rel err = the largest over the checked"
        " tensors, megamoe / torch bf16.",
        "",
        markdown_table(results),
        "",
        f"![TFLOP/s per shape]({png_name})",
        ""])


def plot(results, path):
    """Grouped bars of TFLOP/s per case for megamoe / torch grouped / dense: fwd above, fwd+bwd below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    multi_routing = len({c["routing"] for c in cases}) > 1
    labels = [c["shape"] + (f"\n{c['routing']}" if multi_routing else "") for c in cases]
    series = (("megamoe", "megamoe", "tab:green"), ("torch", "torch _grouped_mm", "tab:blue"),
              ("dense", "dense bf16 GEMM (ceiling)", "tab:gray"))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(cases) + 2), 8), sharey=True)
    width = 0.27
    for ax, (p, title) in zip(axes, PASSES):
        for i, (key, name, color) in enumerate(series):
            vals = [_num(c, "dense", "tflops") if key == "dense" else _num(c, p, key, "tflops") for c in cases]
            xs = [j + (i - 1) * width for j in range(len(cases))]
            bars = ax.bar(xs, [v or 0 for v in vals], width, label=name, color=color)
            for b, v in zip(bars, vals):
                ax.annotate("n/a" if v is None else f"{v:.0f}", (b.get_x() + width / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
        ax.set_title(title)
        ax.set_xticks(range(len(cases)), labels, fontsize=8)
        ax.set_ylabel("TFLOP/s (bf16)")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle(f"megamoe vs torch, {results['gpu']}, {results['date']}, commit {results['commit']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def render(results, json_path):
    """Writes the .md and .png beside json_path (same base name); returns their paths."""
    base = os.path.splitext(json_path)[0]
    png, md = base + ".png", base + ".md"
    with open(md, "w") as f:
        f.write(markdown(results, os.path.basename(png)))
    plot(results, png)
    return md, png


def slug(text):
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def results_path(results, out_dir):
    """<out_dir>/<date>-<gpu slug>-<commit>.json, with -2, -3... appended rather than overwriting a file."""
    base = os.path.join(out_dir, f"{results['date']}-{slug(results['gpu'])}-{slug(results['commit'])}")
    path, n = base + ".json", 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}.json"
    return path


def write(results, out_dir):
    """Writes the JSON, then the markdown, then the PNG of a run; returns the three paths."""
    os.makedirs(out_dir, exist_ok=True)
    path = results_path(results, out_dir)
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    return (path, *render(results, path))
