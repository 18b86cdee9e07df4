"""Plot the loss curves of two or more `train_qwen3_moe.py --log-json` runs into one PNG, with the difference of
each to the first, and print how far apart they are.

    python examples/compare_losses.py megamoe.json grouped_mm.json --out losses.png
"""

import argparse
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the Agg backend)


def load(path):
    """(label, losses, record) of one JSON log."""
    with open(path) as f:
        record = json.load(f)
    label = f"{record.get('experts_impl', path)} ({record.get('median_step_s', float('nan')):.3f} s/step)"
    return label, record["losses"], record


def summary(base, other):
    """max and mean |other - base| over the common steps."""
    diffs = [abs(a - b) for a, b in zip(other, base)]
    return max(diffs), sum(diffs) / len(diffs)


def mean_relative_difference(base, other, last):
    """mean of |other - base| / |base| over the last `last` common steps (DeepSeek-V3's FP8 accuracy measure)."""
    pairs = list(zip(other, base))[-last:]
    return sum(abs(a - b) / abs(b) for a, b in pairs) / len(pairs), len(pairs)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("logs", nargs="+", help="JSON logs of train_qwen3_moe.py --log-json (the first is the base)")
    p.add_argument("--out", default="losses.png", help="PNG to write")
    p.add_argument("--title", default="Qwen3-MoE training loss")
    p.add_argument("--last", type=int, default=100, help="steps of the mean relative difference (default 100)")
    args = p.parse_args(argv)
    if len(args.logs) < 2:
        p.error("give at least two logs")
    runs = [load(path) for path in args.logs]

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1.4]})
    base_label, base, _ = runs[0]
    for label, losses, _ in runs:
        top.plot(range(1, len(losses) + 1), losses, label=label, linewidth=1.2)
    for label, losses, _ in runs[1:]:
        n = min(len(losses), len(base))
        bottom.plot(range(1, n + 1), [losses[i] - base[i] for i in range(n)], label=f"{label} - base", linewidth=1.0)
        worst, mean = summary(base, losses)
        relative, tail = mean_relative_difference(base, losses, args.last)
        print(f"{label} vs {base_label}: max |diff| {worst:.4g}, mean |diff| {mean:.4g} over {n} steps; mean relative "
              f"|diff| over the last {tail} steps {100 * relative:.3f} %")
    bottom.axhline(0.0, color="gray", linewidth=0.6)
    top.set_ylabel("loss")
    top.set_title(args.title)
    top.legend()
    top.grid(alpha=0.3)
    bottom.set_xlabel("step")
    bottom.set_ylabel(f"diff to {base_label.split(' ')[0]}")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
