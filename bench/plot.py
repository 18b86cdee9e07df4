"""Re-renders the markdown table and the PNG plot of bench results from their JSON file(s).

    python bench/plot.py bench/results/2026-01-01-nvidia-h200-abc1234.json [...]

Writes <name>.md and <name>.png beside each JSON file.
"""
import argparse
import json

import report


def main():
    p = argparse.ArgumentParser(description="re-render bench result tables and plots from their JSON files")
    p.add_argument("json_files", nargs="+")
    for path in p.parse_args().json_files:
        with open(path) as f:
            results = json.load(f)
        for case in results["cases"]:
            report.derive(case)
        print("wrote " + ", ".join(report.render(results, path)))


if __name__ == "__main__":
    main()
