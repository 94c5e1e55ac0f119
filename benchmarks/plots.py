"""Plots of a side-by-side suite result (``python -m benchmarks.suite``'s JSON).

- ``NAME-pareto.png``: peak memory against median step time, one point per
  configuration that ran (device memory on CUDA, process RSS on CPU); the
  device budget, if any, as a dashed line; configurations that ran out of
  memory listed in the corner.
- ``NAME-timeline.png``: memory over one training step for the configurations
  that recorded a timeline (device bytes solid, host RSS dashed), with the
  forward/backward/optimizer boundaries.

Redraw from a JSON on any machine with matplotlib::

    python benchmarks/plots.py benchmarks/results/2026-11-30-cpu-suite.json [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["plot_all", "plot_pareto", "plot_timeline"]

_GIB = float(1 << 30)
_COLORS = {"reference": "black", "recompute": "tab:green", "peer": "tab:orange",
           "tiermem": "tab:blue"}


def _plt():
    import matplotlib  # raises ImportError when absent: the caller says so
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _unit(values) -> tuple:
    """(divisor, name): MiB when everything is under 2 GiB, else GiB."""
    vals = [v for v in values if v is not None]
    big = max(vals) if vals else 0
    return (_GIB, "GiB") if big >= 2 * _GIB else (float(1 << 20), "MiB")


def _title(res: dict) -> str:
    m = res.get("model", {})
    mach = res.get("machine") or {}
    dev = ((mach.get("cuda_device") or {}).get("name") if res.get("device") == "cuda"
           else f"CPU ({mach.get('cpu_model', '?')}, {mach.get('logical_cores', '?')} cores)")
    return (f"{res.get('name')}: TinyGPT {m.get('layers')}L w{m.get('width')} s{m.get('seq_len')} "
            f"b{m.get('batch')} {m.get('dtype')} on {dev}")


def plot_pareto(res: dict, path: str) -> str:
    plt = _plt()
    cuda = res.get("device") == "cuda"
    fig, ax = plt.subplots(figsize=(8, 5.5))
    oom, pts = [], []
    for name, e in res["configs"].items():
        st = e.get("step_seconds")
        mem = e.get("peak_device_bytes") if cuda else e.get("peak_host_increase_bytes")
        if e.get("status") == "oom":
            oom.append(name)
            continue
        if st and mem is not None:
            pts.append((name, e, st, mem))
    budget = (res.get("settings") or {}).get("device_budget_bytes") if cuda else None
    div, uname = _unit([p[3] for p in pts] + [budget])
    for name, e, st, mem in pts:
        color = _COLORS.get(e.get("family"), "gray")
        x, y = st["median"] * 1e3, mem / div
        ax.scatter([x], [y], color=color, s=40, zorder=3)
        ax.errorbar([x], [y], xerr=[[(st["median"] - st["min"]) * 1e3],
                                    [(st["max"] - st["median"]) * 1e3]],
                    color=color, alpha=0.4, capsize=2, zorder=2)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    if budget:
        ax.axhline(budget / div, color="red", linestyle="--", linewidth=1)
        ax.text(0.01, budget / div, f" budget {budget / div:.0f} {uname}",
                transform=ax.get_yaxis_transform(), color="red", va="bottom", fontsize=8)
    if oom:
        ax.text(0.99, 0.90, "out of memory: " + ", ".join(oom), transform=ax.transAxes,
                ha="right", va="top", fontsize=8, color="red")
    ax.set_xlabel("step time, median (ms); bars: min–max")
    ax.set_ylabel(f"peak device memory allocated ({uname})" if cuda
                  else f"peak RSS during the steps − RSS after setup ({uname})")
    ax.set_title(_title(res), fontsize=9)
    for fam, col in _COLORS.items():
        ax.scatter([], [], color=col, label=fam)
    ax.legend(fontsize=8, loc="best")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_timeline(res: dict, path: str):
    lines = []
    for name, e in res["configs"].items():
        tl = (e.get("isolated") or {}).get("timeline")
        if tl and tl.get("t_seconds"):
            lines.append((name, tl))
    if not lines:
        return None
    plt = _plt()
    cuda = res.get("device") == "cuda"
    fig, ax = plt.subplots(figsize=(9, 5))
    cmap = plt.get_cmap("tab10")
    allv = [v for _, tl in lines
            for v in (tl["device_bytes"] + tl["host_bytes"] + (tl.get("heap_bytes") or []))
            if v is not None]
    div, uname = _unit(allv)
    for i, (name, tl) in enumerate(lines):
        col = cmap(i % 10)
        t = [x * 1e3 for x in tl["t_seconds"]]
        if cuda and any(v is not None for v in tl["device_bytes"]):
            ax.plot(t, [v / div for v in tl["device_bytes"]], color=col, label=f"{name}: device")
            ax.plot(t, [v / div for v in tl["host_bytes"]], color=col, linestyle="--",
                    label=f"{name}: host RSS")
        else:
            heap = tl.get("heap_bytes") or []
            if heap and all(v is not None for v in heap):
                ax.plot(t, [v / div for v in heap], color=col,
                        label=f"{name}: live malloc bytes")
            ax.plot(t, [v / div for v in tl["host_bytes"]], color=col, linestyle="--",
                    label=f"{name}: RSS")
        for k in ("backward", "optimizer"):
            if k in tl.get("marks", {}):
                ax.axvline(tl["marks"][k] * 1e3, color=col, linestyle=":", alpha=0.6)
    ax.set_xlabel("time since the step's forward started (ms); dotted: backward / optimizer "
                  "start")
    ax.set_ylabel(uname)
    ax.set_title("memory over one step — " + _title(res), fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(res: dict, stem: str) -> list:
    """Write ``STEM-pareto.png`` and ``STEM-timeline.png``; return the paths.
    Raises ImportError when matplotlib is missing."""
    _plt()
    out = [plot_pareto(res, f"{stem}-pareto.png")]
    tl = plot_timeline(res, f"{stem}-timeline.png")
    if tl:
        out.append(tl)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Redraw the suite's plots from its JSON.")
    p.add_argument("json", nargs="+")
    p.add_argument("--out-dir", default=None, help="default: next to each JSON")
    a = p.parse_args(argv)
    try:
        _plt()
    except ImportError as e:
        print(f"plots: matplotlib is not importable ({e}); pip install matplotlib",
              file=sys.stderr)
        return 2
    for path in a.json:
        with open(path) as f:
            res = json.load(f)
        stem = os.path.splitext(os.path.basename(path))[0]
        d = a.out_dir or os.path.dirname(os.path.abspath(path))
        for out in plot_all(res, os.path.join(d, stem)):
            print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
