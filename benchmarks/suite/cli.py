"""The suite's command line: the options, their resolution (defaults < preset <
command line) into the options every child process gets, and ``main`` (a run,
``--rerender``, or a child role)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile

from . import __doc__ as _SUITE_DOC
from .configs import ALL_CONFIGS, DEFAULTS, PRESETS
from .orchestrate import Suite
from .report import finalize
from .roles import child_main
from .util import log, parse_size

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_parser() -> argparse.ArgumentParser:
    # Under -m, argv[0] is the path of __main__.py: name the module instead.
    prog = ("python -m benchmarks.suite" if os.path.basename(sys.argv[0]) == "__main__.py"
            else None)
    p = argparse.ArgumentParser(prog=prog, description=_SUITE_DOC.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="Presets: " + ", ".join(PRESETS))
    p.add_argument("--preset", choices=sorted(PRESETS), default=None)
    p.add_argument("--out-dir", default=os.path.join(BENCH_DIR, "results"))
    p.add_argument("--name", default=None, help="output file stem (default: the preset)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    for k in ("layers", "width", "heads", "seq-len", "batch", "vocab", "warmup", "steps",
              "memory-steps", "memory-jobs"):
        p.add_argument(f"--{k}", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16")
    p.add_argument("--dropout", type=float, default=None)
    p.add_argument("--configs", default=None,
                   help=f"comma-separated, from {','.join(ALL_CONFIGS)}")
    p.add_argument("--timeline", default=None,
                   help="configs whose one-step memory timeline is recorded (comma-separated)")
    p.add_argument("--interleave", dest="interleave", action="store_true", default=None)
    p.add_argument("--no-interleave", dest="interleave", action="store_false")
    p.add_argument("--device-budget", default=None,
                   help="per-process CUDA memory budget (e.g. 24GiB), via "
                        "set_per_process_memory_fraction")
    p.add_argument("--nvme-dir", default=None,
                   help="dir for the nvme tier and the disk ceiling (default: a new temp dir "
                        "under /tmp; use a real disk, not tmpfs)")
    p.add_argument("--min-offload-bytes", type=parse_size, default=None,
                   help="tiermem min_offload_bytes (default: tiermem's)")
    p.add_argument("--tiermem-cpu-budget", default=None,
                   help="tiermem cpu_budget (default: tiermem's: half the available RAM)")
    p.add_argument("--mixed-min-bytes", type=parse_size, default=None,
                   help="tiermem_mixed: tensors this big go to cpu (default: one MLP hidden "
                        "activation)")
    p.add_argument("--io-threads", type=int, default=4)
    p.add_argument("--malloc-mmap-threshold", type=parse_size, default=None,
                   help="set MALLOC_MMAP_THRESHOLD_ (glibc) in every child process, so that "
                        "freed tensors leave the RSS and every configuration runs under the "
                        "same allocator setting (default on CPU: 1MiB, the nvme tier's own "
                        "setting; 0: leave glibc's dynamic threshold)")
    p.add_argument("--ceiling-bytes", type=parse_size, default=None)
    p.add_argument("--ceiling-chunk", type=parse_size, default=None)
    p.add_argument("--max-step-seconds", type=float, default=None,
                   help="drop a config whose warm-up step takes longer")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole run (the C++ engine's build, done first, "
                        "not counted); parts past it are reported as skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-deterministic", dest="deterministic", action="store_false",
                   default=True)
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-build", action="store_true",
                   help="do not build the C++ engine first (a caller that built it: "
                        "gpu_suite.sh); else the first use builds it, inside the probe")
    p.add_argument("--repeat-baseline", action="store_true", default=None,
                   help="also run a second baseline in the interleaved process, to check "
                        "that plain runs are bit-identical here (default: on CUDA only)")
    p.add_argument("--progress", choices=("auto", "bar", "plain", "none"), default="auto")
    p.add_argument("--rerender", metavar="JSON", default=None,
                   help="only redo the merge, Markdown and plots of a (partial) result JSON, "
                        "e.g. of a run stopped by a time limit; writes next to it")
    # children
    p.add_argument("--role", choices=("main", "build", "probe", "interleaved", "isolated"),
                   default="main", help=argparse.SUPPRESS)
    p.add_argument("--child-opts", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    return p


def resolve(args) -> dict:
    """The options of this run: defaults < preset < command line."""
    vals = dict(DEFAULTS)
    if args.preset:
        vals.update(PRESETS[args.preset])
    for k in list(DEFAULTS) + ["device_budget"]:
        v = getattr(args, k.replace("-", "_"), None)
        if k == "timeline":
            v = args.timeline
        if v is not None:
            vals[k] = v
    device = vals["device"]
    if device == "auto":
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("suite: --device cuda, but torch.cuda.is_available() is False")
    configs = [c for c in str(vals["configs"]).split(",") if c]
    bad = [c for c in configs if c not in ALL_CONFIGS]
    if bad:
        sys.exit(f"suite: unknown config(s) {bad}; choose from {ALL_CONFIGS}")
    nvme_dir = args.nvme_dir or tempfile.mkdtemp(prefix="tiermem-suite-nvme-", dir="/tmp")
    from ..models_bench import ModelSpec
    spec = ModelSpec(layers=vals["layers"], width=vals["width"], heads=vals["heads"],
                     seq_len=vals["seq_len"], batch=vals["batch"], vocab=vals["vocab"],
                     dtype=vals["dtype"], dropout=vals["dropout"])
    spec.gpt_config()  # validates
    spec.torch_dtype
    return {
        "device": device, "spec": spec.as_dict(), "configs": configs,
        "timeline_configs": [c for c in str(vals["timeline"]).split(",") if c],
        "warmup": vals["warmup"], "steps": vals["steps"], "memory_steps": vals["memory_steps"],
        "interleave": bool(vals["interleave"]), "memory_jobs": max(1, vals["memory_jobs"]),
        "device_budget_bytes": parse_size(vals.get("device_budget")),
        "nvme_dir": nvme_dir, "nvme_dir_created": args.nvme_dir is None,
        "min_offload_bytes": args.min_offload_bytes, "tiermem_cpu_budget": args.tiermem_cpu_budget,
        "mixed_min_bytes": args.mixed_min_bytes, "io_threads": args.io_threads,
        "malloc_mmap_threshold": (args.malloc_mmap_threshold if args.malloc_mmap_threshold
                                  is not None else (1 << 20 if device == "cpu" else 0)),
        "ceiling_bytes": int(vals["ceiling_bytes"]), "ceiling_chunk": int(vals["ceiling_chunk"]),
        "max_step_seconds": float(vals["max_step_seconds"]),
        "time_limit": float(vals["time_limit"]), "seed": args.seed,
        "deterministic": bool(args.deterministic) and device == "cuda",
        "repeat_baseline": (device == "cuda" if args.repeat_baseline is None
                            else bool(args.repeat_baseline)),
    }


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.role != "main":
        return child_main(args)
    if args.rerender:
        with open(args.rerender) as f:
            res = json.load(f)
        stem = os.path.splitext(os.path.basename(args.rerender))[0]
        finalize(res, os.path.dirname(os.path.abspath(args.rerender)), stem, args.no_plots)
        return 0
    args.name = args.name or args.preset or "suite"
    opts = resolve(args)
    suite = Suite(args, opts)
    try:
        res = suite.run()
    finally:
        if opts.get("nvme_dir_created"):
            shutil.rmtree(opts["nvme_dir"], ignore_errors=True)
    bad = [c for c, e in res["configs"].items()
           if (e.get("exact") or {}).get("bit_identical") is False]
    if bad:
        log(f"[suite] WARNING: losses/state differ from {res.get('exactness_reference')} "
            f"for: {', '.join(bad)}")
    return 0
