"""The result of a run, from its collected parts: each configuration's merge,
the exactness check against the reference, the transfers against the
measured ceilings (link analysis), the notes; writes NAME.json, NAME.md and
the plots. Also what ``--rerender`` redoes on a saved (partial) JSON."""

from __future__ import annotations

import json
import os
from typing import Optional

from .budgets import budget_analysis
from .configs import merge_config
from .markdown import render_markdown
from .util import err_text, log


def finalize(res: dict, out_dir: str, name: str, no_plots: bool = False) -> None:
    """Merge the runs of each configuration into its headline fields, compare
    with the reference, analyse transfers; write NAME.json, NAME.md and plots.
    Also used by ``--rerender`` on the partial JSON of a run that was stopped."""
    s = res["settings"]
    opts = {"spec": res["model"], "interleave": s["interleave"], "device": res["device"]}
    cuda = res["device"] == "cuda"
    confs = res["configs"]
    for c, e in confs.items():
        if e.get("status") == "pending" and not (e.get("interleaved") or e.get("isolated")):
            e["status"] = "not_run"
            e["reason"] = "the run stopped before this configuration ran"
        merge_config(e, opts)
    ref = _reference(confs)
    res["exactness_reference"] = ref
    repeat = (res.get("interleaved") or {}).get("baseline_repeat")
    for c, e in confs.items():
        e["exact"] = _exactness(c, e, ref, confs)
        if repeat and repeat.get("reproducible") is False and e["exact"].get("bit_identical") is False:
            e["exact"]["bit_identical"] = None
            e["exact"]["note"] = ("not determinable: two plain runs of the baseline were not "
                                  "bit-identical on this machine")
    base = confs.get("baseline", {})
    base_t = (base.get("step_seconds") or {}).get("median") if base.get("status") == "ok" else None
    for c, e in confs.items():
        st = e.get("step_seconds")
        e.pop("vs_baseline", None)
        if st and base_t:
            e["vs_baseline"] = st["median"] / base_t
    res["link_analysis"] = link_analysis(res, cuda)
    res["budget_analysis"] = budget_analysis(res)
    for peer in ("torchtune", "deepspeed", "save_on_cpu"):
        p = (res.get("peers") or {}).get(peer)
        if p is None or p.get("ran") is False:
            continue
        e = confs.get(peer)
        p["ran"] = bool(e and e.get("status") in ("ok", "partial"))
        if e and e.get("status") not in ("ok", "partial"):
            p["reason"] = f"{e.get('status')}: {e.get('reason')}"
        if peer == "deepspeed" and e and not cuda:
            p["note"] = ("DeepSpeed's CPU accelerator is a synchronized device, so its "
                         "engine offloads nothing here: this row is checkpointing plus "
                         "its hooks")
    notes = res.setdefault("notes", [])
    for n in (
        "CPU-only machine: the cpu tier, save_on_cpu and the peers move host memory to host "
        "memory; they cost time and save nothing here. Peak memory is the process RSS."
        if not cuda else None,
        "Timing: " + ("interleaved (round-robin in one process, each round's order from a "
                      "Williams design: NOTE [Order of the interleaved steps])"
                      if s["interleave"] else
                      "each configuration alone in its own process, one after another ("
                      + ("a per-process device budget cannot be shared" if
                         s.get("device_budget_bytes") else
                         "one process could not hold every configuration: NOTE "
                         "[Interleaving must fit the device]" if s.get("solo_steps") else
                         "as asked: --no-interleave") + ")")):
        if n and n not in notes:
            notes.append(n)
    if not cuda and s.get("device_budget_bytes"):
        n = "--device-budget is a CUDA allocator budget: it was not applied on the CPU."
        if n not in notes:
            notes.append(n)
    if s.get("malloc_mmap_threshold"):
        n = (f"Every child process ran with MALLOC_MMAP_THRESHOLD_={s['malloc_mmap_threshold']} "
             "(glibc): tensors freed during the step leave the RSS, so peak RSS tracks live "
             "memory, and all configurations share one allocator setting (with glibc's "
             "dynamic threshold, freed activations stay in the heap and RSS barely moves).")
        if n not in notes:
            notes.append(n)
    elif not cuda and "tiermem_nvme" in confs and confs["tiermem_nvme"].get("status") == "ok":
        n = ("tiermem's nvme tier sets glibc's mmap threshold to 1 MiB when its Offloader is "
             "created (tiermem/tiers/nvme.py, NOTE [Freed memory and RSS]); this is "
             "process-wide: "
             + ("in the interleaved process every configuration ran under it; " if s["interleave"]
                else "")
             + "of the isolated runs only tiermem_nvme's process did, which lowers its peak "
             "RSS partly by the allocator setting rather than by moving tensors.")
        if n not in notes:
            notes.append(n)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    md_path = os.path.join(out_dir, f"{name}.md")

    def dump():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)

    dump()
    with open(md_path, "w") as f:
        f.write(render_markdown(res))
    plots = []
    if not no_plots:
        try:
            from .. import plots as plotmod
            plots = plotmod.plot_all(res, os.path.join(out_dir, name))
            res["plots"] = {"written": [os.path.basename(p) for p in plots]}
        except ImportError as e:
            msg = (f"plots skipped: matplotlib is not importable ({e}); redraw later with "
                   f"`python benchmarks/plots.py {os.path.basename(path)}`")
            log(f"[suite] {msg}")
            res["plots"] = {"written": [], "skipped": msg}
        except Exception as e:
            res["plots"] = {"written": [], "error": err_text(e)}
            log(f"[suite] plots failed: {err_text(e)}")
    else:
        res["plots"] = {"written": [], "skipped": "--no-plots"}
    dump()
    log(f"[suite] wrote {path}, {md_path}" + "".join(f", {p}" for p in plots))
    log(render_markdown(res))


def repeat_check(base: Optional[dict], rep: dict) -> dict:
    """Whether two plain runs in the same process were bit-identical."""
    out = {"status": rep.get("status")}
    if base and base.get("status") == "ok" and rep.get("status") == "ok":
        n = min(len(base["losses"]), len(rep["losses"]))
        out["losses_equal"] = base["losses"][:n] == rep["losses"][:n]
        out["state_equal"] = base.get("fingerprint") == rep.get("fingerprint")
        out["reproducible"] = out["losses_equal"] and out["state_equal"]
        out["steps_compared"] = n
    return out


def _reference(confs: dict) -> Optional[str]:
    """The baseline; where it did not run (OOM under a budget), plain
    checkpointing, then selective checkpointing, then any configuration."""
    first = ["baseline", "checkpoint", "sac"]
    order = first + [c for c in confs if c not in first]
    for c in order:
        e = confs.get(c)
        if e and e.get("status") in ("ok", "partial"):
            return c
    return None


def _exactness(name: str, e: dict, ref: Optional[str], confs: dict) -> dict:
    out = {"reference": ref}
    if ref is None or e.get("status") not in ("ok", "partial"):
        return out
    r = confs[ref]
    checks = []
    for mode in ("interleaved", "isolated"):
        mine, theirs = e.get(mode), r.get(mode)
        if not (mine and theirs and mine.get("status") == "ok" and theirs.get("status") == "ok"):
            continue
        la, lb = mine.get("losses") or [], theirs.get("losses") or []
        n = min(len(la), len(lb))
        if n:
            out[f"{mode}_losses_equal"] = la[:n] == lb[:n]
            out[f"{mode}_steps_compared"] = n
            checks.append(out[f"{mode}_losses_equal"])
        fa, fb = mine.get("fingerprint"), theirs.get("fingerprint")
        if fa and fb and len(la) == len(lb):
            out[f"{mode}_state_equal"] = fa == fb
            checks.append(fa == fb)
        if n and la[:n] != lb[:n]:
            diff = [i for i in range(n) if la[i] != lb[i]]
            out[f"{mode}_first_differing_step"] = diff[0]
            out[f"{mode}_max_abs_loss_diff"] = max(abs(la[i] - lb[i]) for i in diff)
    out["bit_identical"] = all(checks) if checks else None
    return out


def link_analysis(res: dict, cuda: bool) -> dict:
    """Seconds of link time per step that each tiermem configuration's moves need,
    against the measured ceilings and the baseline's phase times."""
    ceil = res.get("ceilings") or {}
    confs = res["configs"]
    base = confs.get("baseline", {})
    bph = base.get("phase_seconds_median") if base.get("status") == "ok" else None
    out = {"method": (
        "moved = bytes the tier held per step (cpu + nvme); D2H/H2D seconds = moved / the "
        "pinned link ceiling (CUDA) or the host memcpy ceiling (CPU); disk seconds = nvme "
        "bytes / O_DIRECT write (read) ceiling. bound_step = max(forward, D2H, disk write) + "
        "max(backward, H2D, disk read) + optimizer, with the baseline's phase times: the step "
        "time if every transfer overlapped perfectly with compute (a lower bound that ignores "
        "when each tensor is produced and needed)."), "configs": {}}
    if cuda:
        c = ceil.get("cuda") or {}
        d2h = (c.get("d2h") or {}).get("gbps")
        h2d = (c.get("h2d") or {}).get("gbps")
        link = "pinned PCIe"
    else:
        d2h = h2d = (ceil.get("host_copy") or {}).get("gbps")
        link = "host memcpy"
    disk = ceil.get("disk") or {}
    dw, dr = disk.get("write_gbps"), disk.get("read_gbps")
    out["link"] = link
    for name, e in confs.items():
        tm = e.get("tiermem")
        if not tm or e.get("status") not in ("ok", "partial"):
            continue
        bt = tm["last_step"]["bytes_by_tier"]
        moved = bt.get("cpu", 0) + bt.get("nvme", 0)
        nv = bt.get("nvme", 0)
        a = {"moved_bytes": moved, "nvme_bytes": nv, "kept_bytes": bt.get("keep", 0)}
        if d2h:
            a["d2h_seconds"] = moved / (d2h * 1e9)
        if h2d:
            a["h2d_seconds"] = moved / (h2d * 1e9)
        if nv and dw:
            a["disk_write_seconds"] = nv / (dw * 1e9)
        if nv and dr:
            a["disk_read_seconds"] = nv / (dr * 1e9)
        step = (e.get("step_seconds") or {}).get("median")
        own = e.get("phase_seconds_median")
        if own:
            a["forward_seconds"] = own["forward"]
            a["backward_seconds"] = own["backward"]
            # How busy the link was during this configuration's own phases
            # (>1: the transfers cannot fit inside that phase at the ceiling).
            if "d2h_seconds" in a and own["forward"]:
                a["d2h_over_own_forward"] = a["d2h_seconds"] / own["forward"]
            if "h2d_seconds" in a and own["backward"]:
                a["h2d_over_own_backward"] = a["h2d_seconds"] / own["backward"]
        if bph and "d2h_seconds" in a:
            fwd = max(bph["forward"], a["d2h_seconds"], a.get("disk_write_seconds", 0.0))
            bwd = max(bph["backward"], a["h2d_seconds"], a.get("disk_read_seconds", 0.0))
            a["bound_step_seconds"] = fwd + bwd + bph["optimizer"]
            a["d2h_over_baseline_forward"] = a["d2h_seconds"] / bph["forward"] if bph["forward"] else None
            a["h2d_over_baseline_backward"] = (a["h2d_seconds"] / bph["backward"]
                                               if bph["backward"] else None)
            if step:
                a["measured_over_bound"] = step / a["bound_step_seconds"]
        if step:
            a["measured_step_seconds"] = step
        out["configs"][name] = a
    return out
