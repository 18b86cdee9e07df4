"""Re-renders the markdown table and the PNG plot of bench results from their JSON file(s), or merges the JSONs of
one commit's runs (shapes split over several calls) into one.

    python bench/plot.py bench/results/2026-01-01-nvidia-h200-abc1234.json [...]
    python bench/plot.py --merge bench/results/<date>-<gpu>-<commit>.json run1.json run2.json [...]

Writes <name>.md and <name>.png beside each JSON file (with --merge: the merged JSON, then its .md and .png).
"""
import argparse
import json

import report


def load(path):
    with open(path) as f:
        return json.load(f)


def merge(runs):
    """One results dict from runs of the same commit on the same GPU: the first's header and settings, every case in
    order, the commands joined by ' ; ', each peer and FP8 variant as the run that measured it describes it."""
    first = runs[0]
    for r in runs[1:]:
        if (r.get("commit"), r.get("gpu")) != (first.get("commit"), first.get("gpu")):
            raise ValueError(f"cannot merge runs of different commits or GPUs: {first.get('commit')} on"
                             f" {first.get('gpu')} vs {r.get('commit')} on {r.get('gpu')}")
    merged = dict(first, cases=[c for r in runs for c in r["cases"]], command=" ; ".join(r["command"] for r in runs))
    for key in ("peers", "fp8"):  # the peers and megamoe's FP8 variants: {name: {"about" or "missing": ...}}
        described = {}
        for r in runs:
            for name, info in r.get(key, {}).items():
                if name not in described or "about" in info:
                    described[name] = info
        if any(key in r for r in runs):
            merged[key] = described
    return merged


def main(argv=None):
    p = argparse.ArgumentParser(description="re-render bench result tables and plots from their JSON files")
    p.add_argument("--merge", metavar="OUT_JSON", help="merge the JSON files into OUT_JSON and render that")
    p.add_argument("json_files", nargs="+")
    args = p.parse_args(argv)
    if args.merge:
        results = merge([load(path) for path in args.json_files])
        for case in results["cases"]:
            report.derive(case)
        print("wrote " + ", ".join(report.write(results, args.merge)))
        return
    for path in args.json_files:
        results = load(path)
        for case in results["cases"]:
            report.derive(case)
        print("wrote " + ", ".join(report.render(results, path)))


if __name__ == "__main__":
    main()
