"""The table (and a loss plot) of scripts/gpu_torchtitan.sh's runs: one JSON per run from bench/titan_train.py.

    python bench/titan_report.py RUNS_DIR --json results.json --table table.txt [--plot losses.png]

Per run: torchtitan release, experts (what the model actually holds), compile, steps done, tokens/s (tokens per step
over the median step time, the first steps left out), peak active memory (torchtitan's metric, the whole step's), the
peak allocated before the optimizer step (forward and backward; bench/titan_train.py), the MoE layers' share
of a step (bench/titan_train.py's estimate), and the loss agreement with the run of torchtitan's own experts of the
same model, compile setting and activation checkpointing: the mean and the largest relative difference of the
per-step losses over the steps both ran, and the mean loss of the last 20 of those steps for each. A run named
`<baseline run>-repeat` (torchtitan's own experts again, same seed and data) is compared with that baseline the same
way: torchtitan's run-to-run spread, against which the other runs' loss differences read. A run that failed or was
skipped shows why.
"""

import argparse
import glob
import json
import os
import statistics

BASELINE = "torchtitan"
REPEAT = "-repeat"  # suffix of a baseline run's repeat
LAST = 20


def load(folder):
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path) as f:
            runs[os.path.splitext(os.path.basename(path))[0]] = json.load(f)
    return runs


def agreement(run, baseline):
    """{mean / max relative loss difference over the common steps, last-LAST mean of each} or None."""
    ours, theirs = run.get("losses", []), baseline.get("losses", [])
    common = min(len(ours), len(theirs))
    if common == 0:
        return None
    differences = [abs(a - b) / abs(b) for a, b in zip(ours[:common], theirs[:common])]
    tail = slice(max(0, common - LAST), common)
    return {"steps": common, "mean_rel_diff": statistics.fmean(differences), "max_rel_diff": max(differences),
            "last_mean": statistics.fmean(ours[tail]), "baseline_last_mean": statistics.fmean(theirs[tail])}


def activation_checkpoint_of(run):
    """The run's activation checkpointing: as recorded, else the last --activation_checkpoint.mode of its torchtitan
    command line (JSONs written before bench/titan_train.py recorded it), else None."""
    if run.get("activation_checkpoint"):
        return run["activation_checkpoint"]
    line = run.get("titan_command_line") or []
    modes = [line[i + 1] for i, arg in enumerate(line[:-1]) if arg == "--activation_checkpoint.mode"]
    return modes[-1] if modes else None


def baseline_of(name, run, runs):
    """The run of torchtitan's experts with this run's model, compile setting and activation checkpointing (not a
    repeat)."""
    for other_name, other in runs.items():
        if (other.get("experts_asked") == BASELINE and other.get("model") == run.get("model")
                and other.get("compile") == run.get("compile")
                and activation_checkpoint_of(other) == activation_checkpoint_of(run) and other_name != name
                and not other_name.endswith(REPEAT)):
            return other_name, other
    return None, None


def rows(runs):
    table = []
    for name, run in runs.items():
        share = run.get("experts_share") or {}
        row = {"run": name, "torchtitan": run.get("torchtitan", "?"), "model": run.get("model"),
               "experts": ",".join(run.get("experts", {})) or run.get("experts_asked", "?"),
               "compile": run.get("compile"), "steps": run.get("steps_done", 0),
               "tokens_per_s": run.get("tokens_per_s"), "peak_active_gib": run.get("peak_active_gib"),
               "peak_before_optimizer_gib": run.get("peak_before_optimizer_gib"),
               "moe_share": share.get("share"), "error": run.get("error") or share.get("error")}
        if run.get("experts_asked") != BASELINE or name.endswith(REPEAT):
            base_name, base = baseline_of(name, run, runs)
            if base is not None:
                row["baseline"] = base_name
                row["agreement"] = agreement(run, base)
                if run.get("tokens_per_s") and base.get("tokens_per_s"):
                    row["speedup"] = run["tokens_per_s"] / base["tokens_per_s"]
                if run.get("peak_active_gib") and base.get("peak_active_gib"):
                    row["peak_memory_ratio"] = run["peak_active_gib"] / base["peak_active_gib"]
        table.append(row)
    return table


def text(table):
    def number(value, form):
        return form.format(value) if isinstance(value, (int, float)) else "-"

    lines = [f"{'run':<26} {'titan':>6} {'compile':>7} {'steps':>5} {'tok/s':>9} {'x base':>6} {'peak GiB':>8} "
             f"{'fb GiB':>7} {'MoE %':>6} {'loss d mean/max':>16} {'last-20 loss':>15}"]
    for row in table:
        agree = row.get("agreement") or {}
        losses = (f"{agree['last_mean']:.4f}/{agree['baseline_last_mean']:.4f}" if agree else "-")
        lines.append(f"{row['run']:<26} {row['torchtitan']:>6} {str(bool(row['compile'])):>7} {row['steps']:>5} "
                     f"{number(row['tokens_per_s'], '{:.0f}'):>9} {number(row.get('speedup'), '{:.3f}'):>6} "
                     f"{number(row['peak_active_gib'], '{:.2f}'):>8} "
                     f"{number(row['peak_before_optimizer_gib'], '{:.2f}'):>7} "
                     f"{number(row['moe_share'] and 100 * row['moe_share'], '{:.1f}'):>6} "
                     f"{(number(agree.get('mean_rel_diff'), '{:.2e}') + '/' + number(agree.get('max_rel_diff'), '{:.1e}')) if agree else '-':>16} "
                     f"{losses:>15}")
        if row.get("error"):
            lines.append(f"    {row['run']}: {row['error'][:200]}")
    return "\n".join(lines)


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({run.get("model") for run in runs.values() if run.get("losses")})  # a panel per model that ran
    if not models:
        return
    figure, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4), squeeze=False)
    for axis, model in zip(axes[0], models):
        for name, run in runs.items():
            if run.get("model") == model and run.get("losses"):
                axis.plot(range(1, len(run["losses"]) + 1), run["losses"], label=name, linewidth=1)
        axis.set_title(f"{model} (torchtitan's trainer, synthetic data)")
        axis.set_xlabel("step")
        axis.set_ylabel("loss")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder")
    parser.add_argument("--json", required=True)
    parser.add_argument("--table", required=True)
    parser.add_argument("--plot")
    args = parser.parse_args()
    runs = load(args.folder)
    table = rows(runs)
    with open(args.json, "w") as f:
        json.dump({"rows": table, "runs": runs}, f, indent=1)
    rendered = text(table)
    with open(args.table, "w") as f:
        f.write(rendered + "\n")
    if args.plot and runs:
        try:
            plot(runs, args.plot)
        except ImportError as error:
            print(f"no plot: {error}")
    print(rendered)


if __name__ == "__main__":
    main()
