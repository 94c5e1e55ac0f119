"""The Markdown report of a run: header (machine, model, settings, command),
the side-by-side table, ceilings, transfers against the ceilings, what did not
run, peers and notes."""

from __future__ import annotations

from .budgets import BUDGETS, CI_LEVEL, TOLERANCE, budget_analysis
from .util import fmt_bytes


def _ms(s) -> str:
    return "–" if s is None else f"{s * 1e3:.1f}"


def render_markdown(res: dict) -> str:
    m = res.get("machine") or {}
    mdl = res["model"]
    cuda = res["device"] == "cuda"
    lines = [f"## {res['name']}: side-by-side activation-memory benchmark", ""]
    dev = (m.get("cuda_device") or {}).get("name") if cuda else "none (CPU only)"
    smi = m.get("nvidia_smi") or {}
    lines.append(f"- Date: {m.get('date')}; commit {str(m.get('commit'))[:12]}"
                 f"{' (tiermem/ modified)' if m.get('tiermem_dirty') else ''}")
    lines.append(f"- Machine: GPU {dev}"
                 + (f", driver {smi.get('driver_version')}, PCIe gen {smi.get('pcie_gen_current')}"
                    f" x{smi.get('pcie_width_current')}" if smi else "")
                 + f"; CPU {m.get('cpu_model')} ({m.get('logical_cores')} logical cores); "
                 f"RAM {fmt_bytes(m.get('ram_total_bytes'))}; torch {m.get('torch')}"
                 + (f" (CUDA {m.get('torch_cuda')})" if m.get("torch_cuda") else ""))
    nd = m.get("nvme_dir") or {}
    if nd:
        lines.append(f"- NVMe dir: {nd.get('path')} on {nd.get('device')} ({nd.get('fs_type')}"
                     + (f", {nd.get('model')}" if nd.get("model") else "") + ")")
    lines.append(f"- Model: TinyGPT {mdl['layers']} layers, width {mdl['width']}, "
                 f"{mdl['heads']} heads, seq {mdl['seq_len']}, batch {mdl['batch']}, vocab "
                 f"{mdl['vocab']}, {mdl['dtype']}, dropout {mdl['dropout']}; "
                 f"{mdl.get('parameters', 0) / 1e6:.1f} M parameters; AdamW; "
                 f"{mdl['tokens_per_step']} tokens/step")
    s = res["settings"]
    budget = s.get("device_budget_bytes")
    lines.append(f"- Steps: {s['warmup']} warm-up discarded, {s['steps']} measured "
                 f"({'interleaved round-robin' if s['interleave'] else 'each config alone'})"
                 + (f"; device budget {fmt_bytes(budget)}" if budget else "")
                 + ("; deterministic algorithms" if s.get("deterministic") else ""))
    lines.append(f"- Command: `{' '.join(res['command'])}`")
    lines.append("")
    mem_label = "peak device" if cuda else "peak RSS"
    host_label = "peak host RSS (pinned)" if cuda else "RSS increase"
    lines += [f"| config | status | step ms median (min–max) | × baseline | tokens/s | "
              f"{mem_label} | {host_label} | moved/step (cpu + nvme) | stall ms | late restores "
              f"| = baseline |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, e in res["configs"].items():
        st = e.get("step_seconds")
        step = (f"{_ms(st['median'])} ({_ms(st['min'])}–{_ms(st['max'])})" if st else "–")
        vs = f"{e['vs_baseline']:.2f}" if e.get("vs_baseline") else "–"
        tps = f"{e['tokens_per_second']:,.0f}" if e.get("tokens_per_second") else "–"
        dmem = fmt_bytes(e.get("peak_device_bytes")) if cuda else fmt_bytes(e.get("peak_host_bytes"))
        hmem = fmt_bytes(e.get("peak_host_bytes") if cuda else e.get("peak_host_increase_bytes"))
        if cuda and e.get("peak_pinned_host_bytes") is not None:
            hmem += f" ({fmt_bytes(e['peak_pinned_host_bytes'])})"
        tm = e.get("tiermem")
        moved = stall = late = "–"
        if tm:
            bt = tm["last_step"]["bytes_by_tier"]
            moved = fmt_bytes(bt.get("cpu", 0) + bt.get("nvme", 0))
            if bt.get("nvme"):
                moved += f" ({fmt_bytes(bt['nvme'])} nvme)"
            ss = tm.get("stall_seconds")
            stall = f"{ss['median'] * 1e3:.2f}" if ss else "–"
            late = str(tm.get("late_restores_max", "–"))
        ex = (e.get("exact") or {}).get("bit_identical")
        exs = {True: "yes", False: "**NO**", None: "–"}[ex]
        status = e.get("status", "?")
        if status == "oom":
            status = "**OOM**"
        lines.append(f"| {name} | {status} | {step} | {vs} | {tps} | {dmem} | {hmem} | {moved} "
                     f"| {stall} | {late} | {exs} |")
    lines.append("")
    lines += _budget_lines(res)
    rep = (res.get("interleaved") or {}).get("baseline_repeat")
    if rep and "reproducible" in rep:
        lines.append(f"(Control: a second plain baseline in the same run was "
                     f"{'bit-identical' if rep['reproducible'] else '**not** bit-identical'} "
                     f"to the first over {rep['steps_compared']} steps.)")
        lines.append("")
    ref = res.get("exactness_reference")
    if ref and ref != "baseline":
        lines.append(f"(= baseline: compared with `{ref}`, the baseline did not run to the end.)")
        lines.append("")
    # ceilings
    c = res.get("ceilings") or {}
    lines.append("**Ceilings measured in this run:**")
    hc = c.get("host_copy") or {}
    if hc.get("gbps"):
        lines.append(f"- host memcpy: {hc['gbps']:.1f} GB/s")
    cu = c.get("cuda") or {}
    if cu.get("d2h"):
        lines.append(f"- pinned D2H {cu['d2h']['gbps']:.1f} GB/s, H2D {cu['h2d']['gbps']:.1f} "
                     f"GB/s; both at once: D2H {cu['both']['d2h_gbps']:.1f} + H2D "
                     f"{cu['both']['h2d_gbps']:.1f} GB/s")
    elif cu:
        lines.append(f"- PCIe: {cu.get('skipped') or cu.get('error')}")
    dk = c.get("disk") or {}
    if dk.get("write_gbps"):
        lines.append(f"- NVMe dir ({dk.get('engine')} engine, "
                     f"{'O_DIRECT' if dk.get('direct') else 'buffered'}): write "
                     f"{dk['write_gbps']:.2f} GB/s, read {dk['read_gbps']:.2f} GB/s")
    elif dk:
        lines.append(f"- NVMe dir: {dk.get('error')}")
    la = res.get("link_analysis") or {}
    if la.get("configs"):
        lines += ["", f"**Transfers against the ceilings** (link: {la.get('link')}; seconds per "
                  "step; bound = step time if all transfers overlapped with the baseline's "
                  "compute):", "",
                  "| config | moved/step | D2H s | H2D s | disk w/r s | own fwd/bwd s | "
                  "D2H / own fwd | H2D / own bwd | baseline fwd/bwd s | bound step s | "
                  "measured step s | measured / bound |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        b = res["configs"].get("baseline") or {}
        bph = (b.get("phase_seconds_median") or {}) if b.get("status") == "ok" else {}
        for name, a in la["configs"].items():
            if not a["moved_bytes"]:
                continue

            def f3(x):
                return "–" if x is None else f"{x:.3f}"

            def f2(x):
                return "–" if x is None else f"{x:.2f}"
            dwr = (f"{f3(a.get('disk_write_seconds'))}/{f3(a.get('disk_read_seconds'))}"
                   if a.get("nvme_bytes") else "–")
            mob = a.get("measured_over_bound")
            lines.append(
                f"| {name} | {fmt_bytes(a['moved_bytes'])} | {f3(a.get('d2h_seconds'))} | "
                f"{f3(a.get('h2d_seconds'))} | {dwr} | {f3(a.get('forward_seconds'))}/"
                f"{f3(a.get('backward_seconds'))} | {f2(a.get('d2h_over_own_forward'))} | "
                f"{f2(a.get('h2d_over_own_backward'))} | {f3(bph.get('forward'))}/"
                f"{f3(bph.get('backward'))} | {f3(a.get('bound_step_seconds'))} | "
                f"{f3(a.get('measured_step_seconds'))} | "
                f"{'–' if mob is None else f'{mob:.2f}'} |")
    # not run
    skipped = [(n, e) for n, e in res["configs"].items()
               if e.get("status") not in ("ok", "partial")]
    if skipped:
        lines += ["", "**Not run or failed:**"]
        for n, e in skipped:
            lines.append(f"- `{n}`: {e.get('status')}: {e.get('reason')}")
    peers = res.get("peers") or {}
    lines += ["", "**Peers:** " + "; ".join(
        f"{p}: {'ran' if v.get('ran') else 'did not run'}"
        + (f" ({v.get('reason')})" if v.get("reason") and not v.get("ran") else "")
        + (f" — {v['note']}" if v.get("note") else "")
        for p, v in peers.items())]
    for n in res.get("notes", []):
        lines.append(f"- {n}")
    lines.append("")
    return "\n".join(lines)


def _budget_lines(res: dict) -> list:
    """Saved bytes left in RAM per configuration against 50% / 25% budgets
    (CPU runs), and the auto rows' paired step ratios: :func:`.budgets.budget_analysis`."""
    ba = res.get("budget_analysis") or budget_analysis(res)
    if not ba:
        return []
    confs = res["configs"]
    fastest = {float(b): (e["fastest"], ba["rows"][e["fastest"]]["step_median_s"])
               for b, e in ba["by_budget"].items() if e["fastest"]}
    rows = [(n, r["step_median_s"], r["held_bytes"], r["kept_bytes"],
             [r["meets"][str(b)] for b in BUDGETS], confs[n]) for n, r in ba["rows"].items()]
    base_held = confs["baseline"]["forward_held_bytes"]
    out = ["", "**Saved bytes left in RAM against the planner's budgets** (forward held: "
           "RSS after the forward less before it, isolated run, median; in RAM (tiermem): "
           "bytes_by_tier keep + cpu, last step; the cpu tier's bytes are added to forward "
           "held too (its copies sit in host buffers pooled before the step); a budget is met "
           f"when each measure is within budget x baseline + {TOLERANCE:.0%}; baseline in "
           "RAM = tiermem_keep's):", "",
           "| config | step ms median | × fastest meeting 50% | × fastest meeting 25% | "
           "forward held | share of baseline | in RAM (tiermem) | meets 50% | meets 25% | plan |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, step, held, kept, meets, e in rows:
        rel = [f"{step / fastest[b][1]:.2f}" if b in fastest else "–" for b in BUDGETS]
        plan = (e.get("extra") or {}).get("plan")
        ptxt = "–"
        if plan:
            bt = {k: v for k, v in plan["bytes_by_tier"].items() if v}
            ptxt = (f"budget {fmt_bytes(plan['budget_bytes'])}, predicted kept "
                    f"{fmt_bytes(plan['predicted_kept_bytes'])}, "
                    + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in bt.items())
                    + (f"; stall predicted {plan['predicted_stall_s'] * 1e3:.2f} ms, measured "
                       f"{plan['measured_stall_s'] * 1e3:.2f} ms (last step)"
                       if plan.get("measured_stall_s") is not None else "")
                    + (f"; CPU charge {plan['predicted_cpu_s'] * 1e3:.1f} ms"
                       if plan.get("predicted_cpu_s") else "")
                    + (f"; re-planned {plan['replans']}x: {plan.get('replan_reason') or 'reason not recorded'}"
                       if plan.get("replans") else ""))
        out.append(f"| {name} | {_ms(step)} | {rel[0]} | {rel[1]} | {fmt_bytes(held)} | "
                   f"{held / base_held:.2f} | {fmt_bytes(kept) if kept is not None else '–'} | "
                   f"{'yes' if meets[0] else 'no'} | {'yes' if meets[1] else 'no'} | {ptxt} |")
    for b in BUDGETS:
        if b in fastest:
            out.append(f"- fastest meeting {b:.0%}: {fastest[b][0]} "
                       f"({_ms(fastest[b][1])} ms)")
        else:
            out.append(f"- no configuration meets {b:.0%}")
    for b, e in ba["by_budget"].items():
        for auto, a in e["auto"].items():
            out.append(f"- **{auto} at {float(b):.0%}, paired by round** (auto / other, median "
                       f"and {CI_LEVEL:.0%} bootstrap interval; NOTE [Paired step ratios] in "
                       f"benchmarks/suite/budgets.py): bar ≤ {ba['step_bar']:.2f}x the "
                       f"fastest: **{a['bar_verdict']}**")
            for other, v in a["paired"].items():
                out.append(f"  - vs {other}: " + ("no paired rounds" if v is None else
                           f"{v['median']:.3f} ({v['low']:.3f}–{v['high']:.3f}, "
                           f"{v['n']} rounds)"))
    out.append("")
    return out
