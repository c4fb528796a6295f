"""A model, not a measurement: wall time and work lost for a long run on 100-1000 nodes
that fail at random, with a fixed checkpoint interval and manual resubmission against
the supervisor (``hpctrain launch``) and the interval hpctrain chooses.

    python benchmarks/interval_model.py            # the markdown table of docs/performance.md

Deterministic: every figure follows from the assumptions in ``ASSUMPTIONS`` through
Daly's expected completion time for exponentially distributed failures (J. T. Daly, "A
higher order estimate of the optimum checkpoint interval for restart dumps", FGCS 22,
2006, eq. 3): a run of W seconds of work, saved every tau seconds of work at a cost of C
seconds, on a job whose mean time between failures is M, each failure costing R seconds
of restart (detection, start-up, load; a failure may strike then too) before work goes
on, runs for

    T = M exp(R / M) (exp((tau + C) / M) - 1) W / tau

and suffers T / M failures; with manual resubmission each adds a wait in the queue, during
which nothing runs and nothing fails (wall time = T + failures x wait). Work lost and
redone = T - W - saves x C - failures x R (an approximation: a restart cut short by a
failure costs less than R).

The interval hpctrain chooses with ``checkpoint.mtbf_hours`` is Young's sqrt(2 C M)
(:func:`hpctrain.checkpoint.interval.young_daly_seconds`), C being what the training waits
for: the whole write when saves are synchronous, the snapshot when they are asynchronous.
"""
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hpctrain.checkpoint.interval import young_daly_seconds  # noqa: E402

HOUR, DAY, YEAR = 3600.0, 86400.0, 365.0 * 86400.0

ASSUMPTIONS = {
    "node_mtbf_years": 5.0,  # one node fails every 5 years on average; failures independent
    "work_hours": 168.0,  # the run needs one week of failure-free compute
    "save_sync_s": 60.0,  # a synchronous save blocks training for 60 s (state to the parallel file system)
    "save_async_s": 5.0,  # an asynchronous save blocks for its snapshot, 5 s; the write overlaps training
    "fixed_interval_h": 1.0,  # the fixed interval: checkpoint.every_minutes = 60
    "start_s": 600.0,  # every restart: 10 min to start the ranks and load the checkpoint
    "resubmit_h": 4.0,  # manual: a person notices, resubmits, and the job waits in the queue: 4 h on average
    "supervisor_s": 60.0,  # supervisor: the failure is seen and the ranks relaunched within 1 min
}

NODES = (100, 250, 500, 1000)


def completion(work, tau, save, mtbf, restart):
    """Daly's expected wall time of ``work`` seconds saved every ``tau`` seconds of work."""
    return mtbf * math.exp(restart / mtbf) * (math.exp((tau + save) / mtbf) - 1.0) * work / tau


def strategies(a=ASSUMPTIONS):
    """(name, save cost s, interval rule, restart cost s, wait per failure s) of each strategy."""
    start, supervised, wait = a["start_s"], a["supervisor_s"] + a["start_s"], a["resubmit_h"] * HOUR
    fixed = a["fixed_interval_h"] * HOUR
    return [
        ("fixed 1 h, sync, manual resubmission", a["save_sync_s"], lambda c, m: fixed, start, wait),
        ("fixed 1 h, sync, supervisor", a["save_sync_s"], lambda c, m: fixed, supervised, 0.0),
        ("auto (mtbf_hours), sync, supervisor", a["save_sync_s"], young_daly_seconds, supervised, 0.0),
        ("auto (mtbf_hours), async, supervisor", a["save_async_s"], young_daly_seconds, supervised, 0.0),
    ]


def rows(a=ASSUMPTIONS, nodes=NODES):
    """One dict per (node count, strategy)."""
    work = a["work_hours"] * HOUR
    out = []
    for n in nodes:
        mtbf = a["node_mtbf_years"] * YEAR / n
        for name, save, interval, restart, wait in strategies(a):
            tau = interval(save, mtbf)
            running = completion(work, tau, save, mtbf, restart)
            saves = work / tau
            kills = running / mtbf
            lost = running - work - saves * save - kills * restart
            wall = running + kills * wait
            out.append({"nodes": n, "mtbf_h": mtbf / HOUR, "strategy": name, "interval_min": tau / 60.0,
                        "kills": kills, "restarts_per_day": DAY / mtbf, "overhead": saves * save / wall,
                        "lost_h": lost / HOUR, "down_h": kills * (restart + wait) / HOUR, "wall_days": wall / DAY,
                        "vs_failure_free": wall / work})
    return out


def table(a=ASSUMPTIONS, nodes=NODES):
    lines = ["| nodes | job MTBF | kills in the run | restarts/day | strategy | interval | time blocked in "
             "saves | work lost and redone | down (waiting, restarting) | wall time | x failure-free |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows(a, nodes):
        lines.append(f"| {r['nodes']} | {r['mtbf_h']:.0f} h | {r['kills']:.1f} | {r['restarts_per_day']:.2f} | "
                     f"{r['strategy']} | {r['interval_min']:.0f} min | {100 * r['overhead']:.1f}% | "
                     f"{r['lost_h']:.1f} h | {r['down_h']:.1f} h | {r['wall_days']:.2f} d | "
                     f"{r['vs_failure_free']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print("Assumptions: " + ", ".join(f"{k} = {v:g}" for k, v in ASSUMPTIONS.items()) + "\n")
    print(table())
