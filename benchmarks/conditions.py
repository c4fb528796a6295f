"""Was the machine quiet while a launch measured? Load, CPU steal and other processes' CPU use.

A ratio measured while something else ran is not a property of hpctrain. Around every launch
``run_all`` takes a :func:`snapshot` before and after and :func:`judge` decides whether its
figures may be published:

- the 1-minute load average before the launch at most the core count (nothing else was
  already keeping every core busy);
- other processes' CPU use during the launch (all busy CPU time on the machine minus the CPU
  time of the launch's own processes, per second of wall time) under ``max_foreign_cores``;
- CPU steal (time a hypervisor gave this machine's cores to someone else) under ``max_steal``.

The launch's own CPU time comes from ``getrusage(RUSAGE_CHILDREN)``: mpirun waits for its
ranks, so their time rolls up into it, and into ours when we wait for mpirun.
"""
import os
import resource
import time

MAX_FOREIGN_CORES = 0.5
MAX_STEAL = 0.05


def cpu_times(path="/proc/stat"):
    """Machine-wide CPU seconds since boot: {"busy", "idle", "steal", "total"}."""
    with open(path) as f:
        fields = f.readline().split()
    assert fields[0] == "cpu", fields
    ticks = [int(v) for v in fields[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    user, nice, system, idle, iowait, irq, softirq, steal = (ticks + [0] * 8)[:8]
    hz = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq
    return {"busy": busy / hz, "idle": (idle + iowait) / hz, "steal": steal / hz,
            "total": (busy + idle + iowait + steal) / hz}


def snapshot():
    """What the machine looks like now, and how much CPU our finished children have used."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"time": time.time(), "load_avg": list(os.getloadavg()), "cpus": os.cpu_count(),
            "cpu": cpu_times(), "children_cpu_s": children.ru_utime + children.ru_stime}


def during(before, after):
    """What happened between two snapshots taken around one launch (and nothing else of ours)."""
    wall = max(after["time"] - before["time"], 1e-9)
    d = {k: after["cpu"][k] - before["cpu"][k] for k in ("busy", "idle", "steal", "total")}
    ours = max(after["children_cpu_s"] - before["children_cpu_s"], 0.0)
    return {"seconds": round(wall, 2), "load_before": before["load_avg"], "load_after": after["load_avg"],
            "cpus": before["cpus"], "own_cores": round(ours / wall, 2),
            "foreign_cores": round(max(d["busy"] - ours, 0.0) / wall, 2),
            "steal_fraction": round(d["steal"] / d["total"], 4) if d["total"] > 0 else 0.0}


def judge(cond, max_foreign_cores=MAX_FOREIGN_CORES, max_steal=MAX_STEAL):
    """``(publishable, why)``: why is empty when the figures of this launch may be published."""
    why = []
    if cond["load_before"][0] > cond["cpus"]:
        why.append(f"load {cond['load_before'][0]:.1f} > {cond['cpus']} cores before the launch")
    if cond["foreign_cores"] > max_foreign_cores:
        why.append(f"other processes used {cond['foreign_cores']:.2f} cores during it")
    if cond["steal_fraction"] > max_steal:
        why.append(f"CPU steal {100 * cond['steal_fraction']:.0f}%")
    return not why, "; ".join(why)


def settle(cpus=None, timeout=90.0, poll=2.0, sleep=time.sleep, load=os.getloadavg):
    """Wait (at most ``timeout`` s) until the 1-minute load is below the core count, so a launch
    does not start in the tail of the previous one's load. Returns the seconds waited."""
    cpus = cpus or os.cpu_count()
    waited = 0.0
    while load()[0] > cpus and waited < timeout:
        sleep(poll)
        waited += poll
    return waited
