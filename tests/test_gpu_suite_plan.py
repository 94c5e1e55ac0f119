"""benchmarks/gpu_suite.sh --dry-run: the time plan, GPU tests right after the
build (issue 15 item 6: a cut-short run still gives the GPU tests' verdict)."""

import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _plan(seconds: int):
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_suite.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=30, check=True,
                         env={**os.environ, "TIERMEM_SUITE_SECONDS": str(seconds)}).stdout
    rows = [line.split() for line in out.splitlines()[2:] if line.strip()]
    return {r[0]: (i, int(r[3]), int(r[4])) for i, r in enumerate(rows)}


def test_dry_run_puts_the_gpu_tests_right_after_the_build():
    """Fails before: no --dry-run (usage error), and the doctor ran between."""
    plan = _plan(540)
    order = sorted(plan, key=lambda name: plan[name][0])
    assert order.index("gpu-tests") == order.index("build") + 1, order
    assert order.index("gpu-tests") < min(order.index(p) for p in ("doctor", "size-a", "size-b"))


def test_the_tests_that_spawn_ranks_run_last_and_the_first_benchmark_keeps_its_window():
    """The NCCL-rank tests (a module fixture of up to 240 s that the per-test
    timeout does not cover) come after the benchmark rows, and in the worst
    case (every part before it using its whole cap) size-a still gets the
    time its preset asks for (200 s; it once got 10 s)."""
    plan = _plan(540)
    order = sorted(plan, key=lambda name: plan[name][0])
    assert order[-1] == "gpu-ranks" and order.index("size-b") < order.index("gpu-ranks"), order
    assert plan["size-a"][2] >= 200, plan


def test_dry_run_gives_the_gpu_tests_a_window_within_the_budget():
    for seconds in (540, 600):
        plan = _plan(seconds)
        _, starts_by, limit = plan["gpu-tests"]
        assert limit >= 120, plan                      # room for the tests to give a verdict
        assert starts_by + limit <= seconds, plan
        assert sum(lim for _, _, lim in plan.values()) <= seconds, plan


def test_parts_run_alone_get_the_budget_their_skipped_neighbours_would_have_reserved():
    """TIERMEM_SUITE_PARTS: the parts not named get no window, and a named
    part's reserve counts only the named parts after it (before, env kept 510 s
    for parts a short run skips, and got no window in a 200 s budget)."""
    env = {**os.environ, "TIERMEM_SUITE_SECONDS": "200",
           "TIERMEM_SUITE_PARTS": "env,host-cost host-prof"}
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_suite.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=30, check=True, env=env).stdout
    rows = {r[0]: r for r in (line.split() for line in out.splitlines()[2:] if line.strip())}
    assert [n for n, r in rows.items() if r[4] != "0"] == ["env", "host-cost", "host-prof"], rows
    assert int(rows["env"][4]) == 20 and int(rows["host-cost"][4]) == 75, rows
    assert rows["size-a"][1:4] == ["-", "-", "-"], rows


def test_a_part_name_that_does_not_exist_is_refused_by_name():
    env = {**os.environ, "TIERMEM_SUITE_PARTS": "env hostcost"}
    r = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_suite.sh"), "--dry-run"],
                       capture_output=True, text=True, timeout=30, env=env)
    assert r.returncode == 2 and "'hostcost'" in r.stderr and "host-cost" in r.stderr, r.stderr


def test_a_selection_whose_caps_exceed_the_budget_keeps_the_earlier_parts_whole():
    """With more parts named than the budget holds at their caps, the first
    parts still get their caps and the last get what is left (before, the
    reserves for the later parts left env and the build no window in a 370 s
    budget, and the GPU run skipped the build)."""
    env = {**os.environ, "TIERMEM_SUITE_SECONDS": "370",
           "TIERMEM_SUITE_PARTS": "env build gpu-tests doctor host-cost host-prof gpu-ranks"}
    out = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_suite.sh"), "--dry-run"],
                         capture_output=True, text=True, timeout=30, check=True, env=env).stdout
    rows = {r[0]: r for r in (line.split() for line in out.splitlines()[2:] if line.strip())}
    assert [int(rows[p][4]) for p in ("env", "build", "gpu-tests", "doctor")] == [20, 150, 120, 30]
    assert sum(int(r[4]) for r in rows.values()) <= 370, rows
