"""Regenerates the README's "## Results" block (between <!-- results:begin --> and <!-- results:end -->) from
bench/results/: for balanced routing a table of times per call (a row per shape and pass: the shape's T, H, I, E and
topk, then megamoe and each peer in a column of its own, one number per cell; megamoe's speed-up over SonicMoE is over
the faster of its default and autotuned variants where the run had both, named in the cell) and one of activation
memory, the FP8 table where the run measured FP8 (megamoe FP8 beside megamoe bf16, SonicMoE and torchao FP8), a
sentence on skewed routing, the bench plot, the tables of shapes that run lacks from the newest earlier runs holding
them (with their commits; not without --bench given), and optionally an end-to-end training-step paragraph from two
`examples/train_qwen3_moe.py --log-json` logs.

    python bench/readme_results.py                      # newest bench JSON and training logs in bench/results/
    python bench/readme_results.py --bench bench/results/<date>-<gpu>-<commit>.json \\
        --train-megamoe <...>-megamoe.json --train-baseline <...>-grouped_mm.json --losses-png <...>-losses.png
    python bench/readme_results.py --check              # exit 1 (and print a diff) if README.md is out of date

"Newest" is by the date and the commit in the content (a later commit in git history wins; training logs, which
carry neither, by the <date>-<gpu>-<commit>- prefix of their name), not by file mtime. Only the text between the
markers changes; everything else in the README stays byte-identical. Missing values print as "—".
"""
import argparse
import difflib
import glob
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import report  # noqa: E402  (bench/report.py: derive() and the table helpers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
# The implementations of the README's tables, each a column of its own (the full tables add the FP8 ones).
README_IMPLS = (("megamoe", "megamoe"), ("megamoe_recompute", "megamoe recompute"), ("sonicmoe", "SonicMoE"),
                ("torch_compiled", "torch compiled"), ("torch", "torch eager"))
SIZES = ("T", "H", "I", "E", "topk")
TIME_HEADER = ("shape", *SIZES, "pass", *(f"{label} ms" for _, label in README_IMPLS), "dense GEMM ms",
               "megamoe speed-up over SonicMoE", "megamoe TFLOP/s", "megamoe % of dense")
MEMORY_HEADER = ("shape", *(f"{label} GiB" for _, label in README_IMPLS))
# A run with SonicMoE's autotuned variant (report.sonicmoe_tuned_run) has a column for it beside the default one, and
# megamoe's speed-up is over the faster of the two, named in the cell ("1.02x (tuned)").
README_IMPLS_TUNED = (*README_IMPLS[:3], ("sonicmoe-tuned", "SonicMoE tuned"), *README_IMPLS[3:])
TIME_HEADER_TUNED = ("shape", *SIZES, "pass", *(f"{label} ms" for _, label in README_IMPLS_TUNED), "dense GEMM ms",
                     "megamoe speed-up over SonicMoE (the faster of default / tuned)", "megamoe TFLOP/s",
                     "megamoe % of dense")
MEMORY_HEADER_TUNED = ("shape", *(f"{label} GiB" for _, label in README_IMPLS_TUNED))


def readme_impls(results):
    """The implementations of the README's tables for this run: README_IMPLS_TUNED where it had sonicmoe-tuned."""
    return README_IMPLS_TUNED if report.sonicmoe_tuned_run(results) else README_IMPLS


def _balanced(results):
    return [c for c in results["cases"] if c.get("routing", "balanced") == "balanced"]


def time_rows(results):
    """A row per balanced case and measured pass (the cases derive()d), the columns of TIME_HEADER (TIME_HEADER_TUNED
    where the run had sonicmoe-tuned): the shape, its sizes, each implementation's ms per call, the dense GEMM's (the
    forward's FLOPs: on the fwd row), megamoe's speed-up over SonicMoE (over the faster of its two variants, named,
    where the run had both), its TFLOP/s and its percentage of the dense GEMM's rate (fwd+bwd: against 3x the dense
    time)."""
    impls, tuned = readme_impls(results), report.sonicmoe_tuned_run(results)
    rows = []
    for case in _balanced(results):
        sizes = [report._f(case.get(size), "d") for size in SIZES]
        for p, label in report.PASSES:
            if p not in case:
                continue
            rows.append([case["shape"], *sizes, label,
                         *(report._ms(report._num(case, p, name, "ms")) for name, _ in impls),
                         report._ms(report._num(case, "dense", "ms")) if p == "fwd" else "—",
                         report.vs_sonicmoe(case, p, named=tuned),
                         report._rate(report._num(case, p, "megamoe", "tflops")),
                         report._f(report._num(case, p, "megamoe", "pct_dense"), ".0f")])
    return rows


def memory_rows(results):
    """A row per balanced case with a fwd+bwd pass: each implementation's activation memory in GiB."""
    return [[case["shape"], *(report._f(report._num(case, "fwdbwd", name, "activation_gib"), ".2f")
                              for name, _ in readme_impls(results))]
            for case in _balanced(results) if "fwdbwd" in case]


def result_tables(results):
    """Lines: the times table, then the activation-memory table where the run measured memory (the cases
    derive()d)."""
    tuned = report.sonicmoe_tuned_run(results)
    lines = report.markdown_rows(TIME_HEADER_TUNED if tuned else TIME_HEADER, time_rows(results))
    memory = memory_rows(results)
    if any(cell != "—" for row in memory for cell in row[1:]):
        lines += ["", "Activation memory of a fwd+bwd (extra peak memory minus its gradient outputs):", "",
                  *report.markdown_rows(MEMORY_HEADER_TUNED if tuned else MEMORY_HEADER, memory)]
    return lines


def _commit_rank(commit):
    """How many commits the (first hex word of the) commit has in this repo's history; -1 when unknown."""
    m = re.match(r"[0-9a-f]{7,40}", str(commit or ""))
    try:
        out = m and subprocess.run(["git", "-C", ROOT, "rev-list", "--count", m[0]], capture_output=True, text=True)
        return int(out.stdout) if out and out.returncode == 0 else -1
    except (OSError, ValueError):
        return -1


SKEWED_SUFFIX = "-skewed.json"


def _load(path):
    with open(path) as f:
        return json.load(f)


def _bench_runs(results_dir, skewed):
    """(date, commit rank, path, record) of each bench JSON (a record with "cases") in results_dir: the skewed-routing
    runs kept as <name>-skewed.json when `skewed`, else the others."""
    runs = []
    for p in glob.glob(os.path.join(results_dir, "*.json")):
        if p.endswith(SKEWED_SUFFIX) == skewed:
            r = _load(p)
            if isinstance(r, dict) and "cases" in r:
                runs.append((r.get("date", ""), _commit_rank(r.get("commit")), p, r))
    return runs


def newest_bench(results_dir=RESULTS):
    """The bench JSON of the latest date, then the latest commit, in results_dir. A companion <name>-skewed.json
    (skewed routing run separately) is read along with it, never chosen itself."""
    runs = _bench_runs(results_dir, skewed=False)
    return max(runs)[2] if runs else None


def runs_for_other_shapes(bench_path, results_dir=RESULTS):
    """Bench JSONs older than bench_path (by date, then commit) that hold balanced-routing shapes it lacks, newest
    first, each taken for the shapes no newer run already showed: [(path, [shape, ...])]."""
    newest = _load(bench_path)
    shown = {c["shape"] for c in newest["cases"] if c.get("routing", "balanced") == "balanced"}
    limit = (newest.get("date", ""), _commit_rank(newest.get("commit")))
    picked = []
    for date, rank, path, record in sorted(_bench_runs(results_dir, skewed=False), reverse=True):
        if os.path.abspath(path) == os.path.abspath(bench_path) or (date, rank) > limit:
            continue
        shapes = [c["shape"] for c in record["cases"]
                  if c.get("routing", "balanced") == "balanced" and c["shape"] not in shown]
        shapes = list(dict.fromkeys(shapes))
        if shapes and record.get("peers"):  # only runs with the peers beside megamoe
            picked.append((path, shapes))
            shown.update(shapes)
    return picked


def other_shapes_section(others, readme_dir):
    """Lines: per earlier run, its provenance and the table rows of the shapes it adds."""
    lines = []
    for path, shapes in others:
        results = _load(path)
        results = dict(results, cases=[report.derive(c) for c in results["cases"] if c["shape"] in shapes])
        md = _link(os.path.splitext(path)[0] + ".md", readme_dir)
        lines += ["", f"{', '.join(shapes)}: the newest run of {'this shape' if len(shapes) == 1 else 'these shapes'}"
                  f" ({results.get('date', '—')}, commit `{results.get('commit', '—')}`, command"
                  f" `{results.get('command', '—')}`; [`{md}`]({md})):", "", *result_tables(results)]
    return lines


def newest_skewed(results_dir, results):
    """The newest <name>-skewed.json of the GPU of `results` no newer than it (by date, then commit), or None."""
    limit = (results.get("date", ""), _commit_rank(results.get("commit")))
    runs = [run for run in _bench_runs(results_dir, skewed=True)
            if run[3].get("gpu") == results.get("gpu") and run[:2] <= limit]
    return max(runs)[2] if runs else None


def skewed_runs(results, base, readme_dir):
    """(skewed cases, balanced cases by (shape, routing) to set them against, source note for the sentence): the
    skewed cases of `results` itself; else those of its companion <base>-skewed.json or of the newest earlier one of
    the same GPU (set against that commit's own balanced run when it differs and is there)."""
    by = {(c["shape"], c.get("routing")): c for c in results["cases"]}
    skewed = [c for c in results["cases"] if c.get("routing") == "skewed"]
    if skewed:
        return skewed, by, ""
    path = base + SKEWED_SUFFIX if os.path.exists(base + SKEWED_SUFFIX) else newest_skewed(os.path.dirname(base),
                                                                                          results)
    if path is None:
        return [], by, ""
    companion = _load(path)
    stem = path[: -len(SKEWED_SUFFIX)]  # its balanced run is <stem>.json
    against = ""
    if companion.get("commit") != results.get("commit") and os.path.exists(stem + ".json"):
        by = {(c["shape"], c.get("routing")): report.derive(c) for c in _load(stem + ".json").get("cases", [])}
        against = ", against that commit's balanced run"
    skewed = [report.derive(c) for c in companion.get("cases", []) if c.get("routing") == "skewed"]
    link = _link(stem + "-skewed.md", readme_dir)
    return skewed, by, f" (a separate run, commit `{companion.get('commit', '—')}`{against}: [`{link}`]({link}))"


def newest_train(results_dir=RESULTS):
    """(megamoe log, baseline log, losses png or None) sharing the newest <date>-<gpu>-<commit>-... prefix."""
    groups = {}
    for p in glob.glob(os.path.join(results_dir, "*.json")):
        r = _load(p)
        if isinstance(r, dict) and "experts_impl" in r and "losses" in r:
            prefix = p[: -len(f"-{r['experts_impl']}.json")] if p.endswith(f"-{r['experts_impl']}.json") else p[:-5]
            groups.setdefault(prefix, {})["megamoe" if r["experts_impl"] == "megamoe" else "base"] = p
    pairs = []
    for prefix, g in groups.items():
        if len(g) == 2:
            m = re.match(r"(\d{4}-\d{2}-\d{2})-.*?-([0-9a-f]{7,40})-", os.path.basename(prefix) + "-")
            pairs.append((m.group(1) if m else "", _commit_rank(m and m.group(2)), prefix))
    if not pairs:
        return None, None, None
    prefix = max(pairs)[2]
    png = prefix + "-losses.png"
    return groups[prefix]["megamoe"], groups[prefix]["base"], png if os.path.exists(png) else None


def _link(path, readme_dir):
    return os.path.relpath(path, readme_dir).replace(os.sep, "/")


def kernel_section(results, bench_path, readme_dir):
    """Lines: the provenance line, the balanced-routing table of megamoe and its peers, the peers' note, the skewed
    sentence and the plot."""
    for case in results["cases"]:
        report.derive(case)
    base = os.path.splitext(bench_path)[0]
    commit = str(results.get("commit", "—")) + (" (uncommitted changes)" if results.get("git_dirty") else "")
    md = _link(base + ".md", readme_dir)
    full = f"; full table with errors: [`{md}`]({md})" if os.path.exists(base + ".md") else ""
    lines = [f"One {results.get('gpu', '—')}, bf16, {results.get('date', '—')}, commit `{commit}`, command"
             f" `{results.get('command', '—')}`{full}. Milliseconds per call, lower is better (CUDA events around one"
             " call, the GPU idle before it; the full table adds back-to-back and CUDA-graph times); T tokens, hidden"
             " size H, expert intermediate size I, E experts, topk experts per token. \"torch eager\" / \"torch"
             " compiled\" are the `_grouped_mm` path of `bench/torch_moe_baseline.py` without / with `torch.compile`;"
             " \"dense GEMM\" is a bf16 GEMM of the forward's FLOPs (megamoe's % of dense for fwd+bwd is against 3x"
             " its time)." + (" \"SonicMoE\" runs QuACK's default GEMM configs, \"SonicMoE tuned\" its autotuned"
                              " ones (SonicMoE's own default, autotuned before timing); megamoe's speed-up is over the"
                              " faster of the two, named in the cell." if report.sonicmoe_tuned_run(results) else ""),
             "", *result_tables(results), "", "Peers: " + report.peers_note(results)]
    if report.fp8_measured(results):
        lines += ["", "FP8 beside bf16 (balanced routing, per call; speed-up = megamoe bf16's ms / the row's ms; error ="
                  " the largest relative error against the fp32 reference over the checked tensors):", "",
                  *report.markdown_rows(report.FP8_HEADER, report.fp8_rows(results, "", "balanced"))]
    if report.fp8_note(results):
        lines += ["", report.fp8_note(results)]
    skewed_cases, by, source = skewed_runs(results, base, readme_dir)
    skew = []
    for case in skewed_cases:
        bal = by.get((case["shape"], "balanced"))
        if bal is None:
            continue
        parts = []
        for p, label in report.PASSES:
            s, t = report._num(case, p, "megamoe", "tflops"), report._num(bal, p, "megamoe", "tflops")
            parts.append(f"{label} " + (f"{s / t:.2f}x" if s and t else "—"))
        skew.append(f"{case['shape']} " + ", ".join(parts))
    lines += ["", f"Skewed routing{source} (megamoe TFLOP/s skewed / balanced): " + "; ".join(skew) + "." if skew
              else "Skewed routing: not measured in this run."]
    if os.path.exists(base + ".png"):
        lines += ["", f"![TFLOP/s per shape]({_link(base + '.png', readme_dir)})"]
    return lines


def train_section(mega, baseline, losses_png, readme_dir, paths=()):
    """Lines: one paragraph with the setup, both runs' step time, throughput and peak memory, the speed-up, the largest
    loss difference and links to the loss plot and the logs (the README keeps one table: the kernels')."""
    a = mega.get("args", {})
    steps = list(zip(mega.get("losses") or [], baseline.get("losses") or []))
    max_diff = max((abs(x - y) for x, y in steps), default=None)
    base_s, mega_s = report._num(baseline, "median_step_s"), report._num(mega, "median_step_s")
    model = "a tiny Qwen3-MoE config" if a.get("tiny") else "Qwen3-30B-A3B shapes"
    setup = f"loss `{a.get('loss', 'hf')}`" + (", compiled layers" if a.get("compile_layers") else ", eager layers")
    ra = mega.get("args", {})
    tokens = mega.get("tokens_per_step") or (ra["batch"] * ra["seq"] if "batch" in ra and "seq" in ra else None)

    def run(rec):
        tps = report._num(rec, "tokens_per_s")
        return (f"`{rec.get('experts_impl', '—')}` {report._f(report._num(rec, 'median_step_s'), '.3f')} s per step"
                f" ({'—' if tps is None else f'{tps / 1e3:.1f}k'} tokens/s, peak"
                f" {report._f(report._num(rec, 'peak_memory_gib'), '.1f')} GiB)")

    speedup = f"{base_s / mega_s:.2f}x" if base_s and mega_s else "—"
    losses = f"largest loss difference {max_diff:.1e} over {len(steps)} steps" if steps else "losses not compared"
    links = [f"[loss curves]({_link(losses_png, readme_dir)})"] if losses_png else []
    links += [f"[`{os.path.basename(p)}`]({_link(p, readme_dir)})" for p in paths]
    return [f"Training step (`examples/train_qwen3_moe.py`, {model} with {a.get('layers', '—')} layers, batch"
            f" {a.get('batch', '—')} x {a.get('seq', '—')} = {report._f(tokens, 'd')} tokens per step,"
            f" {a.get('dtype', '—')} AdamW, {setup}, same seed and data, {a.get('steps', '—')} steps, median step time"
            f" after {a.get('warmup', '—')} warm-up steps, {mega.get('device', '—')}): {run(mega)} against the baseline"
            f" {run(baseline)}: {speedup}; {losses}" + (f" ({', '.join(links)})." if links else ".")]


def generate(bench_path, readme_dir, train=None, others=()):
    """The markdown between the markers (no trailing newline); train = (megamoe, baseline, losses png) or None;
    others = runs_for_other_shapes(...): earlier runs' tables of the shapes bench_path lacks."""
    lines = kernel_section(_load(bench_path), bench_path, readme_dir)
    lines += other_shapes_section(others, readme_dir)
    if train and train[0] and train[1]:
        lines += [""] + train_section(_load(train[0]), _load(train[1]), train[2], readme_dir, train[:2])
    return "\n".join(lines)


def replace_block(text, block):
    """text with everything between the markers replaced by block (blank lines around it); ValueError if absent."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < 0 or j < i:
        raise ValueError(f"README markers not found: put `{BEGIN}` and `{END}` (in that order, each on its own line)"
                         " around the body of the '## Results' section")
    return text[: i + len(BEGIN)] + "\n\n" + block + "\n\n" + text[j:]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bench", help="bench JSON (default: the newest in bench/results/)")
    p.add_argument("--train-megamoe", help="train_qwen3_moe.py --log-json of the megamoe run")
    p.add_argument("--train-baseline", help="the same for the baseline run (e.g. grouped_mm)")
    p.add_argument("--losses-png", help="loss plot of examples/compare_losses.py")
    p.add_argument("--no-train", action="store_true", help="no training-step paragraph (default: the newest logs)")
    p.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    p.add_argument("--check", action="store_true", help="exit 1 with a diff if the README is out of date")
    args = p.parse_args(argv)
    if bool(args.train_megamoe) != bool(args.train_baseline):
        p.error("give both --train-megamoe and --train-baseline, or neither")
    bench = args.bench or newest_bench()
    if not bench:
        p.error(f"no bench JSON in {RESULTS}; give --bench")
    train = None if args.no_train else (
        (args.train_megamoe, args.train_baseline, args.losses_png) if args.train_megamoe else newest_train())
    with open(args.readme, encoding="utf-8", newline="") as f:
        old = f.read()
    try:
        others = runs_for_other_shapes(bench) if not args.bench else ()
        new = replace_block(old, generate(bench, os.path.dirname(os.path.abspath(args.readme)), train, others))
    except ValueError as e:
        print(f"error: {args.readme}: {e}", file=sys.stderr)
        return 2
    if args.check:
        if new == old:
            print(f"{args.readme} is up to date")
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), args.readme,
                                                   args.readme + " (regenerated)"))
        print(f"{args.readme} is out of date: run python bench/readme_results.py", file=sys.stderr)
        return 1
    if new != old:
        with open(args.readme, "w", encoding="utf-8", newline="") as f:
            f.write(new)
    print(f"{'updated' if new != old else 'unchanged'} {args.readme} from {bench}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
