"""Plots and a short summary of a run, from its ``metrics.jsonl`` (``hpctrain report RUN_DIR``,
:mod:`hpctrain.commands.report`). Writes ``loss.png`` (training loss and evaluation metrics over steps),
``throughput.png`` (samples/s over wall time), ``ranks.png`` (work time per step of every rank in every
interval: a straggler is a bright row), ``checkpoints.png`` (save time of each checkpoint, when there are any)
and ``summary.txt``, which is also printed (with the restarts of ``hpctrain launch``: cause, rank and host,
ranks before and after, steps lost). Runs on a login node: only matplotlib (Agg, no display) and numpy are
needed. Each ``plot_*`` function returns a matplotlib ``Figure`` (or ``None`` when the run has no such data),
so the series can be checked before anything is written."""
import json
import math
from pathlib import Path

import numpy as np

from ..errors import HpctrainError
from ..job.rundir import METRICS_FILE


def read_metrics(run_dir):
    """The records of ``RUN_DIR/metrics.jsonl``; a line cut short by a killed job is skipped."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise HpctrainError(f"no {METRICS_FILE} in {run_dir}",
                            hint="give the run directory that `hpctrain train` printed at its start "
                                 "(rank 0 writes metrics.jsonl there)")
    records = []
    with open(path) as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not records:
        raise HpctrainError(f"{path} has no records", hint="the run ended before its first logging interval")
    return records


def _kind(records, kind):
    return [r for r in records if r.get("kind") == kind]


def _stamped(records):
    return [r for r in records if isinstance(r.get("timestamp"), (int, float))]


def _start_after(stamped, at):
    """The first ``start`` record after time ``at`` (the launch a restart made), or None."""
    if not isinstance(at, (int, float)):
        return None
    return next((r for r in stamped if r.get("kind") == "start" and r["timestamp"] > at), None)


def restart_events(records):
    """The ``restart`` records of ``hpctrain launch``, with the step the relaunch really resumed from (its
    ``start`` record's ``step``; pure). The supervisor's ``resume_step`` is the newest checkpoint file when it
    decided; a node-local snapshot (``checkpoint.local``) is newer, so ``steps_lost`` is counted again from
    the step resumed wherever the start says it."""
    stamped = _stamped(records)
    events = []
    for r in (r for r in records if r.get("kind") == "restart"):
        e = {k: r.get(k) for k in ("restart", "cause", "rank", "host", "description", "ranks_before", "ranks_after",
                                   "failed_step", "resume_step", "steps_lost")}
        start = _start_after(stamped, r.get("timestamp"))
        if start is not None and isinstance(start.get("step"), int):
            e["resume_step"] = start["step"]
            if isinstance(e["failed_step"], int):
                e["steps_lost"] = max(0, e["failed_step"] - start["step"])
        events.append(e)
    return events


def restart_costs(records):
    """Per ``restart`` record of ``hpctrain launch``, the time from the last step before the failure to the first
    step after it, part by part (pure): ``{"restart", "total", "logged", "parts": {part: seconds}}``. The steps
    are known from the logged ones (every ``monitor.log_every``): the steps trained between the last logged step
    and the failure (up to the one a survivor kept: ``kept_step``; else none are counted) and those between the
    resumed step and the first logged after it are training, not the restart's, and are taken out at their
    logged step time (``logged``: the time between the two logged steps, with them). The parts: until the
    launcher was gone (the failure noticed, every rank ended), the supervisor's decision, until the new ranks
    ran, rank 0's start-up parts (its ``start`` record: imports, MPI, backend, run directory, data, model,
    resume), the monitor's set-up, and the first step. Times from several hosts mix their clocks."""
    costs = []
    stamped = _stamped(records)
    logged = [r for r in stamped if r.get("kind") == "train"]
    for restart in (r for r in stamped if r.get("kind") == "restart"):
        at = restart["timestamp"]
        before = [r for r in logged if r["timestamp"] < at]
        start = _start_after(stamped, at)
        if not before or start is None:
            continue
        first = next((r for r in logged if r["timestamp"] > start["timestamp"]), None)
        last, kept, resumed = before[-1], restart.get("kept_step"), start.get("step")
        # the last step before the failure, and the first after the restart, as times
        ended_step = last["timestamp"] + _steps_of(last, (kept or 0) - last.get("step", 0))
        ended, began = restart.get("launch_ended"), start.get("process_started")
        parts = {}
        if ended:
            parts["launcher gone"] = ended - ended_step
            parts["decision"] = at - ended
        if began:  # a warm spare set was started ahead: it only had to be called
            parts["spares called" if start.get("spare") else "ranks started"] = began - at
        parts.update(start.get("startup") or {})
        if began:
            parts["monitor"] = start["timestamp"] - began - sum((start.get("startup") or {}).values())
        first_step = None
        if first is not None:
            after = first.get("step", 0) - (resumed if isinstance(resumed, int) else first.get("step", 0)) - 1
            first_step = first["timestamp"] - _steps_of(first, after)
            parts["first step"] = first_step - start["timestamp"]
        costs.append({"restart": restart.get("restart"), "parts": {k: round(v, 3) for k, v in parts.items()},
                      "total": None if first is None else round(first_step - ended_step, 3),
                      "logged": None if first is None else round(first["timestamp"] - last["timestamp"], 3)})
    return costs


def _steps_of(record, count):
    """Seconds ``count`` steps took at ``record``'s logged step time (none when it has none, or ``count`` < 0)."""
    step_time = record.get("step_time")
    return max(0, count) * step_time if isinstance(step_time, (int, float)) else 0.0


def _figure(*, nrows=1, figsize=(8, 4.5)):
    # Figure without pyplot: no global state, no display needed, Agg canvas on savefig.
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, layout="constrained")
    return fig, fig.subplots(nrows, 1, squeeze=False)[:, 0]


def plot_loss(records):
    """Training loss (per logging interval) and every numeric eval metric, over steps."""
    train = [r for r in _kind(records, "train") if r.get("loss") is not None]
    evals = _kind(records, "eval")
    if not train and not evals:
        return None
    fig, (ax_loss, ax_eval) = _figure(nrows=2, figsize=(8, 6.5))
    if train:
        ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    losses = [r for r in evals if isinstance(r.get("val_loss"), (int, float))]
    if losses:
        ax_loss.plot([r["step"] for r in losses], [r["val_loss"] for r in losses], "o-", label="val_loss")
    for i, r in enumerate(_kind(records, "nonfinite")):  # a mark where a step was not finite
        ax_loss.axvline(r.get("step", 0), color="red", linestyle=":", linewidth=1,
                        label="non-finite step" if i == 0 else None)
    for i, r in enumerate(r for r in _kind(records, "restart") if r.get("failed_step") is not None):
        ax_loss.axvline(r["failed_step"], color="black", linestyle="--", linewidth=1,
                        label="failure, relaunched (hpctrain launch)" if i == 0 else None)
    rates = [r for r in train if isinstance(r.get("lr"), (int, float))]
    if len({r["lr"] for r in rates}) > 1:  # a schedule or a warm-up: the learning rate on its own axis
        ax_lr = ax_loss.twinx()
        ax_lr.plot([r["step"] for r in rates], [r["lr"] for r in rates], color="gray", linewidth=1,
                   label="learning rate")
        ax_lr.set_ylabel("learning rate")
        ax_lr.legend(loc="upper center")
    ax_loss.set(xlabel="step", ylabel="loss", title="loss")
    positive = [r["loss"] for r in train if r["loss"] > 0] + [r["val_loss"] for r in losses if r["val_loss"] > 0]
    if positive and max(positive) / min(positive) > 100:
        ax_loss.set_yscale("log")
    ax_loss.legend()
    names = sorted({k for r in evals for k, v in r.items()
                    if isinstance(v, (int, float)) and k not in ("step", "epoch", "time", "timestamp", "val_loss")})
    for name in names:
        points = [(r["step"], r[name]) for r in evals if isinstance(r.get(name), (int, float))]
        ax_eval.plot(*zip(*points), "o-", label=name)
    ax_eval.set(xlabel="step", title="evaluation metrics")
    if names:
        ax_eval.legend()
    else:
        ax_eval.text(0.5, 0.5, "no evaluation metrics", ha="center", va="center", transform=ax_eval.transAxes)
    return fig


def plot_throughput(records):
    """Samples/s (or steps/s when samples are not known) over minutes of wall time."""
    train = _kind(records, "train")
    if not train:
        return None
    key = "samples_per_s" if any(r.get("samples_per_s") for r in train) else "steps_per_s"
    points = [r for r in train if r.get(key) is not None]
    t0 = records[0].get("timestamp", points[0]["timestamp"] if points else 0)
    fig, (ax,) = _figure()
    ax.plot([(r["timestamp"] - t0) / 60 for r in points], [r[key] for r in points], ".-",
            label=key.replace("_per_s", "/s"))
    ax.set(xlabel="wall time (min)", ylabel=key.replace("_per_s", "/s"), title="throughput")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


def rank_matrix(records, field="work"):
    """``(ranks x intervals)`` seconds per step of ``field`` (NaN: unknown), and the step of each interval."""
    timed = [r for r in _kind(records, "train") if r.get("ranks")]
    if not timed:
        return np.zeros((0, 0)), []
    size = max(len(r["ranks"]) for r in timed)
    matrix = np.full((size, len(timed)), np.nan)
    for col, r in enumerate(timed):
        for row in r["ranks"]:
            if row.get(field) is not None:
                matrix[row["rank"], col] = row[field]
    return matrix, [r["step"] for r in timed]


def plot_rank_heatmap(records):
    """Work time per step (ms) of every rank in every interval. All-reduce wait is left out:
    in synchronous training the fast ranks wait for the slow one, so wait hides stragglers."""
    matrix, steps = rank_matrix(records)
    if matrix.size == 0:
        return None
    fig, (ax,) = _figure(figsize=(8, max(3.0, 0.35 * matrix.shape[0] + 2)))
    image = ax.imshow(matrix * 1e3, aspect="auto", interpolation="nearest", cmap="viridis")
    fig.colorbar(image, ax=ax, label="work per step (ms)")
    ax.set(xlabel="interval (last step)", ylabel="rank",
           title="per-rank work time per step (data + forward/backward + optimizer)")
    ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 10)).astype(int))
    ax.set_xticks(ticks, [str(steps[i]) for i in ticks])
    if matrix.shape[0] <= 32:
        ax.set_yticks(range(matrix.shape[0]))
    return fig


def plot_checkpoints(records):
    """Save time of each checkpoint against its step."""
    saves = [r for r in _kind(records, "checkpoint") if r.get("seconds") is not None]
    if not saves:
        return None
    fig, (ax,) = _figure()
    ax.plot([r["step"] for r in saves], [r["seconds"] for r in saves], "o-", label="save time")
    ax.set(xlabel="step", ylabel="seconds", title="checkpoint save time")
    ax.set_ylim(bottom=0)
    ax.legend()
    return fig


def summarize(records):
    """The numbers of ``summary.txt`` as a dict (pure)."""
    train = _kind(records, "train")
    steps = [r["step"] for r in records if isinstance(r.get("step"), int)]
    # wall time: each start record opens a segment (a resumed run appends a new one)
    wall, segment_start, last = 0.0, None, None
    for r in (r for r in records if r.get("timestamp") is not None):
        if r.get("kind") == "start":
            if segment_start is not None:
                wall += last - segment_start
            segment_start = r["timestamp"]
        last = r["timestamp"]
    if segment_start is not None:
        wall += last - segment_start
    seconds = [r["steps"] * r["step_time"] for r in train if r.get("step_time") and r.get("steps")]
    rates = [(r.get("samples_per_s"), r["steps"] * r["step_time"]) for r in train
             if r.get("step_time") and r.get("steps") and r.get("samples_per_s")]
    hosts = {}
    for r in _kind(records, "start"):
        hosts.update(enumerate(r.get("hosts") or []))
    matrix, _ = rank_matrix(records)
    slowest = None
    if matrix.size and np.isfinite(matrix).any():
        means = np.nanmean(np.where(np.isfinite(matrix), matrix, np.nan), axis=1)
        rank = int(np.nanargmax(means))
        median = float(np.nanmedian(means))
        slowest = {"rank": rank, "host": hosts.get(rank, "?"), "work": float(means[rank]),
                   "median_work": median, "ratio": float(means[rank] / median) if median > 0 else math.inf}
    saves = [r["seconds"] for r in _kind(records, "checkpoint") if r.get("seconds") is not None]
    gathers = [r["gather"] for r in train if r.get("gather")]
    memory = max((r["memory"] for r in train if r.get("memory")), key=lambda m: m["peak_rss_mib_max"], default=None)
    evals = _kind(records, "eval")
    return {
        "steps": max(steps) if steps else 0,
        "steps_run": sum(r.get("steps") or 0 for r in train),
        "wall_seconds": wall,
        "samples_per_s": (sum(v * d for v, d in rates) / sum(d for _, d in rates)) if rates else None,
        "steps_per_s": (sum(r["steps"] for r in train if r.get("step_time")) / sum(seconds)) if seconds else None,
        "final_loss": next((r["loss"] for r in reversed(train) if r.get("loss") is not None), None),
        "last_eval": {k: v for k, v in evals[-1].items() if k not in ("kind", "time", "timestamp")} if evals else None,
        "ranks": max(len(hosts), matrix.shape[0]),
        "slowest": slowest,
        "peak_memory": memory,  # the highest peak resident memory of any rank, and which
        "slow_rank_reports": [{k: r.get(k) for k in ("rank", "host", "phase", "ratio", "step")}
                              for r in _kind(records, "slow_rank")],
        "divergences": [{"step": r.get("step"), "ranks": r.get("ranks")} for r in _kind(records, "divergence")],
        "nonfinite": [{k: r.get(k) for k in ("step", "action", "tensor")} for r in _kind(records, "nonfinite")],
        "early_stop": next(({k: r.get(k) for k in ("step", "metric", "best", "best_step", "evaluations", "patience")}
                            for r in reversed(_kind(records, "early_stop"))), None),
        # hpctrain launch: each relaunch after a failure, and why it stopped relaunching
        "restarts": restart_events(records),
        "launch_stops": [{k: r.get(k) for k in ("reason", "description", "why")}
                         for r in _kind(records, "launch_stop")],
        "restart_costs": restart_costs(records),
        # slurm/resilient.sbatch's standby: the first node lost, and the run finished from another
        "takeovers": [{k: r.get(k) for k in ("host", "lost", "noticed", "last_step", "seconds_since_last_step",
                                             "ranks")} for r in _kind(records, "takeover")],
        "standby_ends": [{k: r.get(k) for k in ("host", "status", "stood_still_s")}
                         for r in _kind(records, "job_end") if r.get("by") == "standby"],
        "checkpoints": len(_kind(records, "checkpoint")),
        "checkpoint_mean_seconds": float(np.mean(saves)) if saves else None,
        "gather_mean_seconds": float(np.mean([g["seconds"] for g in gathers])) if gathers else None,
        "gather_mean_fraction": float(np.mean([g["fraction"] for g in gathers if g.get("fraction") is not None]))
        if any(g.get("fraction") is not None for g in gathers) else None,
    }


def format_summary(s):
    def num(value, fmt):
        return "n/a" if value is None else format(value, fmt)

    resumed = f" ({s['steps_run']} in this directory's runs)" if s["steps_run"] != s["steps"] else ""
    lines = [f"steps: {s['steps']}{resumed}",
             f"wall time: {s['wall_seconds']:.1f} s",
             f"mean throughput: {num(s['samples_per_s'], '.1f')} samples/s ({num(s['steps_per_s'], '.2f')} steps/s)",
             f"final training loss: {num(s['final_loss'], '.4g')}"]
    if s["last_eval"]:
        values = ", ".join(f"{k} {'nan' if v is None else format(v, '.4g')}" for k, v in s["last_eval"].items()
                           if k not in ("step", "epoch") and (v is None or isinstance(v, (int, float))))
        lines.append(f"last evaluation (step {s['last_eval'].get('step')}): {values}")
    if s.get("peak_memory"):
        m = s["peak_memory"]
        lines.append(f"peak memory: {m['peak_rss_mib_max']:.0f} MiB resident on rank {m['rank']} ({m['host']}), "
                     f"the most of any rank")
    if s["slowest"]:
        w = s["slowest"]
        lines.append(f"slowest rank: {w['rank']} on {w['host']}: {w['work'] * 1e3:.1f} ms of work per step, "
                     f"{w['ratio']:.2f}x the median rank ({s['ranks']} ranks)")
    if s["slow_rank_reports"]:
        named = sorted({(r["rank"], r["host"], r["phase"]) for r in s["slow_rank_reports"]})
        lines.append("slow ranks reported: " + "; ".join(f"rank {r} on {h} (phase {p}, #SBATCH --exclude={h})"
                                                        for r, h, p in named))
    else:
        lines.append("slow ranks reported: none")
    if s["divergences"]:
        lines.append("parameters diverged: " + "; ".join(f"ranks {d['ranks']} at step {d['step']}"
                                                        for d in s["divergences"]))
    if s.get("nonfinite"):
        events = s["nonfinite"]
        counts = ", ".join(f"{n} {a}" for a in ("skip", "rollback", "stop")
                           if (n := sum(e["action"] == a for e in events)))
        shown = "; ".join(f"step {e['step']} {e['action']} ({e['tensor']})" for e in events[:5])
        lines.append(f"non-finite steps: {len(events)} ({counts}): {shown}" + (" ..." if len(events) > 5 else ""))
    if s.get("early_stop"):
        e = s["early_stop"]
        lines.append(f"early stop at step {e['step']}: {e['metric']} not improved for {e['evaluations']} evaluations "
                     f"(patience {e['patience']}; best {num(e['best'], '.4g')} at step {e['best_step']})")
    if s.get("restarts"):
        events = s["restarts"]
        lost = sum(e["steps_lost"] or 0 for e in events)
        shown = "; ".join(f"step {'?' if e['failed_step'] is None else e['failed_step']}: {e['description']}; "
                          f"{e['ranks_before']} -> {e['ranks_after']} ranks, "
                          f"{'?' if e['steps_lost'] is None else e['steps_lost']} step(s) lost" for e in events)
        lines.append(f"restarts: {len(events)} ({lost} step(s) lost in all): {shown}")
    for cost in s.get("restart_costs") or []:
        parts = ", ".join(f"{k} {v:.2f}" for k, v in cost["parts"].items())
        lines.append(f"restart {cost['restart']} cost {num(cost['total'], '.2f')} s from the last step to the first "
                     f"after it ({num(cost.get('logged'), '.2f')} s between the logged steps around it): {parts}")
    for stop in s.get("launch_stops") or []:
        lines.append(f"not restarted: {stop['description']}: {stop['why']}")
    for t in s.get("takeovers") or []:
        how = t.get("noticed") or f"Slurm took {t['lost']} out of the job"
        lines.append(f"first node lost ({t['lost']}: job script, supervisor): {how}, after step {t['last_step']}; "
                     f"the standby on {t['host']} relaunched {t['ranks']} rank(s)")
    for end in s.get("standby_ends") or []:
        lines.append(f"the standby on {end['host']} ended the job: status {end['status']}, training stood still "
                     f"{num(end['stood_still_s'], '.1f')} s")
    lines.append(f"checkpoints: {s['checkpoints']}, mean save time {num(s['checkpoint_mean_seconds'], '.3f')} s")
    if s["gather_mean_seconds"] is not None:
        lines.append(f"timing gather: {s['gather_mean_seconds'] * 1e3:.2f} ms each, "
                     f"{num(None if s['gather_mean_fraction'] is None else 100 * s['gather_mean_fraction'], '.2f')}% "
                     f"of the step time it covers")
    return "\n".join(lines) + "\n"


def figures(records):
    """``{name: Figure}`` for the plots this run has data for."""
    made = {"loss": plot_loss(records), "throughput": plot_throughput(records),
            "ranks": plot_rank_heatmap(records), "checkpoints": plot_checkpoints(records)}
    return {name: fig for name, fig in made.items() if fig is not None}


def write_report(run_dir, out_dir=None):
    """Write the PNGs and ``summary.txt``; returns ``(summary_text, {name: png_path})``."""
    records = read_metrics(run_dir)
    out = Path(out_dir) if out_dir else Path(run_dir) / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, fig in figures(records).items():
        paths[name] = out / f"{name}.png"
        fig.savefig(paths[name], dpi=100)
    text = format_summary(summarize(records))
    (out / "summary.txt").write_text(text)
    return text, paths
