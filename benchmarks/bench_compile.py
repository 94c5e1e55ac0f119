"""Step time of TinyGPT eager vs with compiled blocks, without and with tiermem.

Method: two copies of one TinyGPT (same weights): ``eager``, and ``compiled``
whose blocks are ``torch.compile(block, backend=--backend)`` (the head,
embeddings and loss stay eager). Each is run without tiermem (``plain``) and
under one Offloader per policy of ``--policies`` (kept across rounds;
``auto`` at ``--budget``, no nvme directory: on the CPU it can only
recompute). One round runs one training step (forward, backward; no
optimizer) of every configuration in turn; the first ``--warmup`` rounds
(compiles, auto's profiled step) are discarded and each configuration's
figure is the median over the other rounds, with its ratio to the plain
eager step's median. Per configuration the last step's saved tensors as
tiermem counted them (``count_by_tier``, bytes) say what the hooks saw:
under compile, only the tensors the compiled graphs save at their boundary.

The plain rows run with tiermem's module hooks installed (they return at
once between steps: NOTE [Hooks held between steps] in
tiermem/tracking/modules.py), as they are while any Offloader is open.

Run: ``python benchmarks/bench_compile.py [--out results.json]``. Prints JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
import warnings

import torch

import tiermem
from common import add_gpt_args, emit, gpt_config, machine, summarize


def _step(model, idx, targets, ctx) -> float:
    gc.collect()
    t0 = time.perf_counter()
    if ctx is None:
        loss = model(idx, targets)
    else:
        with ctx:
            loss = model(idx, targets)
    loss.backward()
    dt = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_gpt_args(ap)
    ap.add_argument("--backend", default="inductor")
    ap.add_argument("--policies", default="keep,cpu,recompute,auto")
    ap.add_argument("--budget", default="50%", help="auto's device_budget")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dropout is None:
        args.dropout = 0.0
    warnings.filterwarnings("ignore", message=".*global hooks on modules.*")
    from tiermem.models import TinyGPT

    torch.manual_seed(0)
    cfg = gpt_config(args)
    eager = TinyGPT(cfg)
    compiled = copy.deepcopy(eager)
    for i, b in enumerate(compiled.blocks):
        compiled.blocks[i] = torch.compile(b, backend=args.backend)
    idx = torch.randint(0, cfg.vocab, (args.batch, args.seq_len))
    targets = torch.randint(0, cfg.vocab, (args.batch, args.seq_len))

    policies = [p for p in args.policies.split(",") if p]
    configs = []   # (name, model, offloader or None)
    for mode, model in (("eager", eager), ("compiled", compiled)):
        configs.append((f"{mode}/plain", model, None))
        for p in policies:
            settings = {"device_budget": args.budget} if p == "auto" else {}
            configs.append((f"{mode}/{p}", model,
                            tiermem.Offloader(policy=p, min_offload_bytes=0, **settings)))
    times = {name: [] for name, _, _ in configs}
    compile_s = None
    for r in range(args.warmup + args.rounds):
        for name, model, off in configs:
            dt = _step(model, idx, targets, off)
            if name == "compiled/plain" and r == 0:
                compile_s = dt
            if r >= args.warmup:
                times[name].append(dt)
    rows = {}
    base = summarize(times["eager/plain"])["median"]
    for name, _, off in configs:
        s = summarize(times[name])
        row = {"step_s": s, "vs_eager_plain": s["median"] / base}
        if off is not None:
            st = off.stats
            row["saved_count_by_tier"] = dict(st.count_by_tier)
            row["saved_bytes_by_tier"] = dict(st.bytes_by_tier)
            row["recompute_count"] = st.recompute_count
            off.close()
        rows[name] = row
    emit({"benchmark": "bench_compile", "machine": machine(),
          "args": vars(args), "first_compiled_step_s": compile_s,
          "load_average_end": list(__import__("os").getloadavg()), "configs": rows}, args.out)


if __name__ == "__main__":
    main()
