"""Predicted against measured kept bytes over a followed ``auto`` step, from
``benchmarks/bench_costmodel.py``'s JSON: per auto configuration, the plan's
``kept_timeline()`` (kept bytes after each planned tensor's save, by pack
index) as a line and the step's ``bytes_by_tier['keep']`` sampled after each
module's forward as points, with the budget dashed.

Run: ``python benchmarks/plot_kept_timeline.py RESULT.json [--out PNG]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plots import _plt  # noqa: E402

_MIB = float(1 << 20)


def plot(res: dict, path: str) -> str:
    plt = _plt()
    rows = [(n, c) for n, c in res["configs"].items()
            if c["steps"] and "predicted_kept_timeline" in c["steps"][-1]]
    fig, axes = plt.subplots(1, max(1, len(rows)), figsize=(6 * max(1, len(rows)), 4.5),
                             squeeze=False)
    for ax, (name, c) in zip(axes[0], rows):
        last = c["steps"][-1]
        pred = last["predicted_kept_timeline"]
        ax.step([0] + [i for i, _ in pred], [0] + [b / _MIB for _, b in pred], where="post",
                label="predicted (plan)", color="tab:blue")
        meas = last.get("kept_samples") or []
        ax.plot([i for i, _ in meas], [b / _MIB for _, b in meas], ".", color="tab:red",
                label="measured (after each module's forward)")
        budget = last.get("budget_bytes")
        if budget:
            ax.axhline(budget / _MIB, ls="--", color="gray", label="budget")
        ax.set_title(f"{name}: predicted kept {last['predicted_kept_bytes'] / _MIB:.1f} MiB, "
                     f"measured {last['kept_bytes'] / _MIB:.1f} MiB", fontsize=9)
        ax.set_xlabel("saved tensors so far (pack index)")
        ax.set_ylabel("kept saved bytes (MiB)")
        ax.legend(fontsize=8)
    m = res.get("model", {})
    fig.suptitle(f"{res.get('name')}: TinyGPT {m.get('layers')}L w{m.get('width')} "
                 f"s{m.get('seq_len')} b{m.get('batch')}, 2-core CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("result")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    with open(args.result) as f:
        res = json.load(f)
    out = args.out or os.path.splitext(args.result)[0] + "-kept-timeline.png"
    print(plot(res, out))


if __name__ == "__main__":
    main()
