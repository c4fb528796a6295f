"""The table of a benchmark run: ``python benchmarks/report.py bench-results/<timestamp>``.

Ratios are against a baseline measured in the same launch (or, for step times across
implementations, the same command), medians of the repetitions. Absolute times are shown
for scale only: this machine is shared, and they move by 2x from one minute to the next.
"""
import glob
import json
import os
import re
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zero_memory  # noqa: E402  (its section of the table)
import recipes  # noqa: E402  (its section of the table)

MIB = 2 ** 20

TARGETS = {
    "step": 1.0,          # step time / DDP's
    "sync": 1.2,          # gradient synchronisation / one fused Allreduce of the same bytes
    "small_sync": 1.5,    # the same for 256 KiB - 4 MiB through Horovod
    "save_vs_torch": 1.0,  # hpctrain save time / torch.save+fsync
    "save_vs_raw": 0.8,   # hpctrain save bandwidth / raw tofile+fsync bandwidth (at least)
    "load_vs_torch": 1.0,  # hpctrain load time / torch.load
    "peak_mem": 0.10,     # extra resident memory during save / state size
    "async_stall": 0.25,  # training stall of an async_save / of a synchronous save
}


def load(out):
    docs = {}
    for path in sorted(glob.glob(os.path.join(out, "*.json"))):
        name = os.path.basename(path)[:-5]
        if name == "launches":
            continue
        try:
            with open(path) as f:
                docs[name] = json.load(f)
        except (OSError, ValueError):
            continue
    return docs


def ok(value, limit, higher_is_better=False):
    if value is None:
        return "n/a"
    good = value >= limit if higher_is_better else value <= limit
    return "met" if good else "MISSED"


def fmt(value, spec=".2f", suffix=""):
    return "-" if value is None else f"{value:{spec}}{suffix}"


def size_name(nbytes):
    return f"{nbytes / MIB:g} MiB" if nbytes >= MIB else f"{nbytes / 1024:g} KiB"


def allreduce_section(docs, verdicts):
    lines = ["## 1. Gradient all-reduce (hpctrain `backend.synchronize`, 16 tensors) vs one fused mpi4py Allreduce",
             "",
             "Cells: time / time of one fused float32 `Allreduce` of the same bytes in the same launch "
             "(median; <= 1.2 is the target). busbw = bytes/time x 2(n-1)/n, fp16 counting the half "
             "that travels. The Horovod launch's fused baseline runs beside Horovod's background thread.",
             "",
             "| ranks | size | fused busbw GB/s (mpi launch) | mpi none | mpi fp16 | fused busbw GB/s (hvd launch) "
             "| horovod none | horovod fp16 | busbw GB/s mpi none / hvd none / hvd fp16 |",
             "|---|---|---|---|---|---|---|---|---|"]
    found = False
    for n in (2, 4):
        m, h = docs.get(f"allreduce-mpi-{n}"), docs.get(f"allreduce-horovod-{n}")
        if not m and not h:
            continue
        found = True
        rows = {}
        for doc in (m, h):
            for r in (doc or {}).get("results", []):
                key = ("hvd_" if doc is h and r["path"] == "fused_allreduce" else "") + r["path"]
                rows.setdefault(r["bytes"], {})[key] = r
        for nbytes in sorted(rows):
            r = rows[nbytes]
            get = lambda k, f="ratio_to_fused": r.get(k, {}).get(f)  # noqa: E731
            lines.append(
                f"| {n} | {size_name(nbytes)} | {fmt(get('fused_allreduce', 'busbw_gbs'))} "
                f"| {fmt(get('mpi_none'))} | {fmt(get('mpi_fp16'))} | {fmt(get('hvd_fused_allreduce', 'busbw_gbs'))} "
                f"| {fmt(get('horovod_none'))} | {fmt(get('horovod_fp16'))} "
                f"| {fmt(get('mpi_none', 'busbw_gbs'))} / {fmt(get('horovod_none', 'busbw_gbs'))} / "
                f"{fmt(get('horovod_fp16', 'busbw_gbs'))} |")
            if nbytes >= 4 * MIB:
                for path in ("mpi_none", "horovod_none"):
                    if get(path) is not None:
                        verdicts.append((f"sync {path.replace('_', ' ')} {size_name(nbytes)} {n} ranks "
                                         f"<= 1.2x fused", get(path), ok(get(path), TARGETS["sync"]),
                                         [f"allreduce-{path.split('_')[0]}-{n}"]))
    cycle = docs.get("allreduce-horovod-cycle1-2")
    if found and cycle:
        default = {r["bytes"]: r for r in docs.get("allreduce-horovod-2", {}).get("results", [])
                   if r["path"] == "horovod_none"}
        lines += ["", "Horovod's cycle time: `allreduce-horovod-2` runs with hpctrain's default "
                  "(`HOROVOD_CYCLE_TIME=0.2` ms), `allreduce-horovod-cycle1-2` with Horovod's own (1 ms); "
                  "small buffers, where the wait for the next cycle dominates:", "",
                  "| size | 0.2 ms cycle: ms, x fused | 1 ms cycle: ms, x fused | fused ms (1 ms launch) |",
                  "|---|---|---|---|"]
        for r in cycle["results"]:
            if r["path"] != "horovod_none":
                continue
            d = default.get(r["bytes"], {})
            fused = next((x for x in cycle["results"] if x["bytes"] == r["bytes"] and x["path"] == "fused_allreduce"), {})
            lines.append(f"| {size_name(r['bytes'])} | {fmt(d.get('median_s', 0) * 1e3)}, {fmt(d.get('ratio_to_fused'))} "
                         f"| {fmt(r['median_s'] * 1e3)}, {fmt(r['ratio_to_fused'])} | {fmt(fused.get('median_s', 0) * 1e3)} |")
    return (lines + small_buffer_lines(docs, verdicts)) if found else []


def small_buffer_lines(docs, verdicts):
    """Horovod on small buffers: the 16 tensors, one tensor, and the cost of any Horovod
    all-reduce (4 bytes), against 1.5x one fused Allreduce. Horovod pays that floor and then
    moves the bytes with an Allreduce of its own, so floor + one fused Allreduce bounds any
    Horovod path from below: where the bound is over 1.5x, no fusion reaches the target."""
    doc = docs.get("allreduce-horovod-2")
    rows = {}
    for r in (doc or {}).get("results", []):
        if r["bytes"] <= 4 * MIB:
            rows.setdefault(r["bytes"], {})[r["path"]] = r
    if not any("horovod_floor" in r for r in rows.values()):
        return []
    # The baseline: the Allreduce of the mpi launch, where no Horovod thread shares the rank's
    # core. Beside Horovod's thread, each rank's two threads spin waiting for the other rank's
    # other thread until the scheduler's tick, and the Allreduce itself takes up to 4-8 ms.
    clean = {r["bytes"]: r for r in docs.get("allreduce-mpi-2", {}).get("results", []) if r["path"] == "fused_allreduce"}
    limit = TARGETS["small_sync"]
    lines = ["", f"Small buffers through Horovod (2 ranks, `allreduce-horovod-2`): the target is {limit:g}x one "
             "fused `Allreduce`, here the one of `allreduce-mpi-2` (no Horovod thread beside it; the "
             "Horovod launch's own is shown for comparison). The floor is one 4-byte Horovod all-reduce: "
             "the part of every call that does not depend on its size (the wait for the background thread's "
             "next cycle, the negotiation among ranks, the hand-offs between threads). After it Horovod still "
             "moves the bytes with an Allreduce of its own: floor + fused is a lower bound for any Horovod "
             "path, and where it is over the target, no fusing of the gradients reaches it through Horovod.", "",
             f"| size | fused ms | fused ms beside Horovod | {limit:g}x fused ms | floor (4 B) ms "
             "| floor + fused ms | one tensor ms, x fused | 16 tensors ms, x fused | bound over the target |",
             "|---|---|---|---|---|---|---|---|---|"]
    for nbytes in sorted(rows):
        r = rows[nbytes]
        if "fused_allreduce" not in r or "horovod_floor" not in r:
            continue
        ms = lambda k: r.get(k, {}).get("median_s", 0) * 1e3  # noqa: E731
        base = clean.get(nbytes, r["fused_allreduce"])["median_s"] * 1e3
        x = lambda k: ms(k) / base if k in r else None  # noqa: E731
        bound = ms("horovod_floor") + base
        over = bound > limit * base
        lines.append(f"| {size_name(nbytes)} | {fmt(base, '.3f')} | {fmt(ms('fused_allreduce'), '.3f')} | "
                     f"{fmt(limit * base, '.3f')} | {fmt(ms('horovod_floor'), '.3f')} | {fmt(bound, '.3f')} | "
                     f"{fmt(ms('horovod_one_tensor'), '.3f')}, {fmt(x('horovod_one_tensor'))} | "
                     f"{fmt(ms('horovod_none'), '.3f')}, {fmt(x('horovod_none'))} | {'yes' if over else 'no'} |")
        if x("horovod_none") is not None:
            verdicts.append((f"small sync horovod none {size_name(nbytes)} 2 ranks <= {limit:g}x fused",
                             x("horovod_none"), ok(x("horovod_none"), limit),
                             ["allreduce-horovod-2"] + (["allreduce-mpi-2"] if nbytes in clean else [])))
    return lines


def step_rounds(docs, model, n):
    """``{round: {implementation: (launch name, results)}}`` of the training-step launches."""
    out = {}
    for name, doc in docs.items():
        if doc.get("benchmark") != "train_step" or doc["ranks"] != n or doc["results"]["model"] != model:
            continue
        r = doc["results"]
        found = re.search(r"-r(\d+)$", name)
        key = f"{r['impl']} {r['compression']}" if r["impl"] != "ddp" else "ddp"
        if r.get("cycle_asked_ms") is not None:  # Horovod with a cycle time other than hpctrain's
            key += f" {r['cycle_asked_ms']:g} ms cycle"
        if r.get("mpi_waits_asked") == "spin":  # Open MPI's own waits, against hpctrain's default
            key += " MPI waits spin"
        out.setdefault(int(found.group(1)) if found else 0, {})[key] = (name, r)
    return out


def step_docs(docs, model, n):
    """The first round's results by implementation."""
    rounds = step_rounds(docs, model, n)
    return {k: r for k, (_, r) in rounds[min(rounds)].items()} if rounds else {}


def spread(values):
    """``(median, "min-max")`` of the non-missing values; ``(None, "")`` when there are none."""
    values = sorted(v for v in values if v is not None)
    if not values:
        return None, ""
    return statistics.median(values), (f"{values[0]:.2f}-{values[-1]:.2f}" if len(values) > 1 else "")


def train_section(docs, verdicts):
    lines = []
    for model in ("large", "small"):
        rounds = step_rounds(docs, model, 2)
        rs = step_docs(docs, model, 2)
        if not rs:
            continue
        ddp = rs.get("ddp")
        any_r = next(iter(rs.values()))
        lines += ["", f"## 2. Training step, {model} model ({any_r['parameters'] / 1e6:.1f}M parameters in "
                      f"{any_r['tensors']} tensors, {any_r['grad_bytes'] / MIB:.0f} MiB of gradients), 2 ranks, "
                      f"batch {any_r['batch_per_rank']}/rank, 1 torch thread/rank",
                  "",
                  "x DDP: step / DDP's step (direct, launches minutes apart); x DDP (norm.): the same after "
                  "dividing each by its own launch's communication-free step (`local`), which cancels load "
                  "that changed between launches. exposed comm = step - local. sync: time in "
                  "`backend.synchronize` (after the backward pass; Horovod overlaps part of it with backward).",
                  "",
                  f"With {len(rounds)} rounds (DDP and the backends launched alternately), the ratios are "
                  "each round's against that round's DDP: median, and min-max over the rounds.",
                  "",
                  "| implementation | step ms | x DDP | x DDP (norm.) | norm. min-max | step / local "
                  "| exposed comm ms | sync ms | sync / fused Allreduce | fused Allreduce ms |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for key in ("ddp", "horovod none", "horovod fp16", "horovod none 1 ms cycle", "horovod none MPI waits spin",
                    "mpi none", "mpi fp16"):
            r = rs.get(key)
            if not r:
                continue
            pairs = [(rd[key], rd["ddp"]) for rd in rounds.values() if key in rd and "ddp" in rd]
            direct, _ = spread([a["step_s"] / b["step_s"] for (_, a), (_, b) in pairs])
            norm, norm_range = spread([a["step_over_local"] / b["step_over_local"] for (_, a), (_, b) in pairs])
            lines.append(f"| {key} | {fmt(1e3 * r['step_s'], '.0f')} | {fmt(direct)} | {fmt(norm)} | {norm_range} "
                         f"| {fmt(r['step_over_local'])} | {fmt(1e3 * r['exposed_comm_s'], '.0f')} "
                         f"| {fmt(1e3 * r['sync_s'], '.0f') if key != 'ddp' else 'in backward'} "
                         f"| {fmt(r['sync_over_fused'])} | {fmt(1e3 * r['fused_allreduce_s'], '.0f')} |")
            if key not in ("ddp", "horovod none MPI waits spin") and norm is not None:
                names = [name for pair in pairs for name, _ in pair]
                verdicts.append((f"step {key}, {model} model, <= DDP (normalised)", norm,
                                 ok(norm, TARGETS["step"]), names))
        if "horovod none MPI waits spin" in rs:
            lines += ["", "MPI waits spin: Open MPI's own setting for a rank that is not oversubscribed, where "
                          "hpctrain could not set its default (MPI started first). The waiting thread slows the "
                          "launch's local step too, so read its direct x DDP, not the normalised one; it is "
                          "no target's row."]
    return lines


def scaling_section(docs):
    lines = ["", "## 4. Scaling at a fixed per-rank batch (large model, 64 samples/rank/step)", "",
             "Weak scaling: ideal is a constant step time. 4 ranks on 2 cores are oversubscribed (two ranks "
             "per core), so the 4-rank column measures time-sharing, not scaling.", "",
             "| implementation | 1 rank ms | 2 ranks ms | 4 ranks ms (oversubscribed) | t1/t2 | t1/t4 |",
             "|---|---|---|---|---|---|"]
    found = False
    for impl in ("horovod none", "ddp"):
        t = {n: step_docs(docs, "large", n).get(impl) for n in (1, 2, 4)}
        if not any(t.values()):
            continue
        found = True
        s = {n: (r["step_s"] if r else None) for n, r in t.items()}
        eff = lambda n: s[1] / s[n] if s[1] and s[n] else None  # noqa: E731
        lines.append(f"| {impl} | {fmt(s[1] and 1e3 * s[1], '.0f')} | {fmt(s[2] and 1e3 * s[2], '.0f')} "
                     f"| {fmt(s[4] and 1e3 * s[4], '.0f')} | {fmt(eff(2))} | {fmt(eff(4))} |")
    return lines if found else []


def ckpt_section(docs, verdicts):
    doc = docs.get("ckpt_io-2")
    if not doc:
        return []
    res = doc["results"]
    rows = {r["method"]: r for r in res["methods"]}
    torch_r, raw = rows.get("torch"), rows.get("raw")
    lines = ["", f"## 3. Checkpoint I/O, {res['state_bytes'] / 2 ** 30:.2f} GiB state (MLP + AdamW moments, "
                 f"{res['tensors']} tensors), 2 ranks", "",
             "save includes fsync; load (cold) reads a file dropped from the page cache, warm load the "
             "same file again from memory. raw = numpy tofile+fsync "
             "/ readinto on one rank; torch = torch.save+fsync / torch.load+load_state_dict on one rank; "
             "torch_all = the same file loaded by every rank (a replicated resume); "
             "hpctrain = save_checkpoint (checksums, parallel HDF5 write, verify re-read, fsync, rename) / "
             "load_checkpoint on 2 ranks; dcp = torch.distributed.checkpoint over gloo on 2 ranks. "
             "peak extra = highest RSS above the level before the save, worst rank.", "",
             "| method | save s | save min-max | save x torch | save GB/s | save BW / raw BW | load s "
             "| load min-max | load x torch | warm load s | warm load x torch | peak extra / state |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    every, dcp = rows.get("torch_all"), rows.get("dcp")
    for name in ("raw", "torch", "torch_all", "hpctrain", "hpctrain_noverify", "hpctrain_unaligned",
                 "hpctrain_collective", "hpctrain_direct", "hpctrain_buffered", "dcp"):
        r = rows.get(name)
        if not r:
            continue
        vs_torch = r["save_s"] / torch_r["save_s"] if torch_r else None
        vs_raw = raw["save_s"] / r["save_s"] if raw else None
        load_vs = r["load_s"] / torch_r["load_s"] if torch_r and r["load_s"] else None
        warm = r.get("load_warm_s")
        warm_vs = warm / torch_r["load_warm_s"] if torch_r and warm and torch_r.get("load_warm_s") else None
        lines.append(f"| {name} | {fmt(r['save_s'])} | {spread(r.get('save_samples_s') or [])[1]} | {fmt(vs_torch)} "
                     f"| {fmt(r['save_gbs'])} | {fmt(vs_raw)} | {fmt(r['load_s'])} "
                     f"| {spread(r.get('load_samples_s') or [])[1]} | {fmt(load_vs)} | {fmt(warm)} | {fmt(warm_vs)} "
                     f"| {fmt(100 * r['peak_extra_fraction'], '.0f', '%')} |")
        if name == "hpctrain":
            verdicts += [("checkpoint save <= torch.save+fsync", vs_torch, ok(vs_torch, TARGETS["save_vs_torch"])),
                         ("checkpoint save >= 80% raw bandwidth", vs_raw, ok(vs_raw, TARGETS["save_vs_raw"], True)),
                         ("checkpoint load <= torch.load", load_vs, ok(load_vs, TARGETS["load_vs_torch"])),
                         ("checkpoint load <= torch.load (warm cache)", warm_vs, ok(warm_vs, TARGETS["load_vs_torch"])),
                         ("peak extra memory during save < 10% of state", r["peak_extra_fraction"],
                          ok(r["peak_extra_fraction"], TARGETS["peak_mem"]))]
            more = []
            if every and every.get("load_s"):
                ratio = r["load_s"] / every["load_s"]
                more.append(("checkpoint load <= torch.load on every rank", ratio, ok(ratio, TARGETS["load_vs_torch"])))
            if dcp:
                for what in ("save", "load"):
                    if r.get(f"{what}_s") and dcp.get(f"{what}_s"):
                        ratio = r[f"{what}_s"] / dcp[f"{what}_s"]
                        more.append((f"checkpoint {what} <= DCP (memory pre-touched)", ratio, ok(ratio, 1.0)))
            verdicts += more
            n = 5 + len(more)
            verdicts[-n:] = [v + (["ckpt_io-2"],) for v in verdicts[-n:]]
    if res.get("dcp_error"):
        lines.append(f"\ndcp did not run: {res['dcp_error']}")
    lines += stall_lines(res.get("stall"), "ckpt_io-2", "2 ranks on 2 cores: each rank's writer shares a core "
                         "with the training", verdicts)
    one = docs.get("ckpt_io-stall-1")
    if one:
        lines += stall_lines(one["results"].get("stall"), "ckpt_io-stall-1",
                             "1 rank given both cores (mpirun --bind-to none): the writer has a core of its "
                             "own, as on a node with more cores than ranks", verdicts)
    return lines


CKPT_SETTINGS = (
    ("fresh process", "one save and load per launch, as after a relaunch"),
    ("trained first", "training steps of the state's model before the repetitions, as a rollback or a resume "
                      "after some work"))


EXTRA_ROWS = {"hpctrain": "", "hpctrain_buffered": "buffered writes (as before the shared mappings)",
              "hpctrain_direct": "with checkpoint.direct_io"}


def ckpt_samples(docs, names, method):
    """Every save and cold-load sample of ``method`` in the launches ``names``."""
    saves, loads = [], []
    for name in names:
        for row in docs[name]["results"]["methods"]:
            if row["method"] == method:
                saves += row.get("save_samples_s") or []
                loads += row.get("load_samples_s") or []
    return saves, loads


def ckpt_settings_section(docs, verdicts):
    """hpctrain against DCP in the two settings a user's process meets, no memory touched beforehand:
    ``ckpt_io-fresh-<method>-r<round>`` (the methods alternate over launches) and ``ckpt_io-trained-2``."""
    launches = {"fresh process": sorted(n for n in docs if n.startswith("ckpt_io-fresh-")),
                "trained first": [n for n in ("ckpt_io-trained-2",) if n in docs]}
    lines = []
    # hpctrain's default; as extra rows without a verdict, the buffered writes of before the shared mappings and
    # checkpoint.direct_io (an option).
    for (setting, how), method in [(s, m) for s in CKPT_SETTINGS for m in EXTRA_ROWS]:
        names = launches[setting]
        ours, dcp = ckpt_samples(docs, names, method), ckpt_samples(docs, names, "dcp")
        if not (ours[0] and dcp[0]):
            continue
        if not lines:
            first = docs[names[0]]["results"]
            gib = first["state_bytes"] / 2 ** 30
            lines = ["", f"### Checkpoint I/O as a user's process meets it: {gib:.2f} GiB, 2 ranks, no memory "
                         "touched beforehand (section 3's table pre-touches it before each save and load: an "
                         "extra row, which users' processes do not have)", "",
                     "| setting | samples | hpctrain save s | min-max | DCP save s | min-max | save / DCP "
                     "| hpctrain load s | min-max | DCP load s | min-max | load / DCP |",
                     "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        (s_ours, s_range), (s_dcp, s_dcp_range) = spread(ours[0]), spread(dcp[0])
        (l_ours, l_range), (l_dcp, l_dcp_range) = spread(ours[1]), spread(dcp[1])
        save_ratio = s_ours / s_dcp if s_ours and s_dcp else None
        load_ratio = l_ours / l_dcp if l_ours and l_dcp else None
        label = f"{setting} ({how})" if method == "hpctrain" else f"{setting}, {EXTRA_ROWS[method]}"
        lines.append(f"| {label} | {len(ours[0])} + {len(dcp[0])} | {fmt(s_ours)} | {s_range} "
                     f"| {fmt(s_dcp)} | {s_dcp_range} | {fmt(save_ratio)} | {fmt(l_ours)} | {l_range} "
                     f"| {fmt(l_dcp)} | {l_dcp_range} | {fmt(load_ratio)} |")
        if method == "hpctrain":
            verdicts += [(f"checkpoint save <= DCP ({setting})", save_ratio, ok(save_ratio, 1.0), names),
                         (f"checkpoint load <= DCP ({setting})", load_ratio, ok(load_ratio, 1.0), names)]
    floors = {m: spread(ckpt_samples(docs, launches["trained first"], m)[0])
              for m in ("raw_shared", "raw_per_rank")}
    if lines and all(median for median, _ in floors.values()):
        (shared, shared_range), (own, own_range) = floors["raw_shared"], floors["raw_per_rank"]
        within = lambda r: f" ({r})" if r else ""  # noqa: E731
        lines += ["", f"The floors in the trained-first launch, every rank writing its share with plain writes "
                      f"and an fsync: into one shared file (hpctrain's layout) {shared:.2f} s"
                      f"{within(shared_range)}, into a file of its own (DCP's) {own:.2f} s{within(own_range)}, "
                      f"{shared / own:.2f}x."]
    return lines


def stall_lines(stall, launch, setting, verdicts):
    """The stall table of one launch, and its verdict."""
    if not stall:
        return []
    lines = ["", f"Training stall of one `CheckpointManager.save` (`{launch}`, {setting}; mpi backend, batch "
                 f"8/rank, same state): training steps run until the save is durable (at least "
                 f"{stall['steps']}); stall = their time with the save - as many steps without. other CPU = "
                 f"CPU seconds the process spent outside the training thread meanwhile (the background write, "
                 f"checksums, verification, fsync).", "",
             "| mode | stall s | stall min-max | stall / sync stall | save() blocks s | steps | step s "
             "| other CPU s |",
             "|---|---|---|---|---|---|---|---|"]
    for mode in ("sync", "async"):
        s = stall[mode]
        lines.append(f"| {mode} | {fmt(s['stall_s'])} | {spread(s.get('stall_samples_s') or [])[1]} "
                     f"| {fmt(s['stall_s'] / stall['sync']['stall_s'])} | {fmt(s['blocking_s'])} "
                     f"| {fmt(s.get('steps'), '.0f')} | {fmt(s['step_s'])} | {fmt(s.get('other_cpu_s'))} |")
    ratio = stall["async"]["stall_s"] / stall["sync"]["stall_s"] if stall["sync"]["stall_s"] > 0 else None
    verdicts.append((f"async_save stall <= {TARGETS['async_stall']}x a synchronous save's ({launch})", ratio,
                     ok(ratio, TARGETS["async_stall"]), [launch]))
    return lines


def extra_section(docs):
    known = ("allreduce-", "train_step-", "ckpt_io-", "comm_modes-", "zero_memory-", "recipes-")  # their own sections
    other = {k: v for k, v in docs.items() if not k.startswith(known)}
    lines = []
    for name, doc in other.items():
        lines += ["", f"## {name} (as written by its script)", "", "```",
                  json.dumps(doc.get("results", doc), indent=1, sort_keys=True)[:4000], "```"]
    return lines


def render(out):
    docs = load(out)
    verdicts = []
    lines = [f"# Benchmarks: {out}", ""]
    machine = next((d.get("machine") for d in docs.values() if d.get("machine")), None)
    if machine:
        lines.append(f"Machine: {machine.get('cpus')} CPUs, {machine.get('mem_total_gib')} GiB, "
                     f"{machine.get('mpi', 'MPI ?').rstrip(chr(0)).strip()}, torch {machine.get('torch')}, Horovod "
                     f"{machine.get('horovod', '-')}, HDF5 {machine.get('hdf5', '-')}; load average at the "
                     f"first launch {', '.join(f'{x:.1f}' for x in machine.get('load_avg', []))}")
    launches = read_launches(out)
    if launches:
        failed = [e["name"] for e in launches["launches"] if e["rc"] != 0]
        lines.append(f"Launches: {len(launches['launches'])}{' (quick)' if launches.get('quick') else ''}, "
                     f"failed: {', '.join(failed) or 'none'}; load average at the end "
                     f"{', '.join(f'{x:.1f}' for x in launches.get('load_avg_end', []))}")
        lines += conditions_lines(launches["launches"])
    lines.append("")
    lines += allreduce_section(docs, verdicts)
    lines += train_section(docs, verdicts)
    lines += ckpt_section(docs, verdicts)
    lines += ckpt_settings_section(docs, verdicts)
    lines += scaling_section(docs)
    lines += zero_memory.section(docs, verdicts)
    lines += recipes.section(docs)
    lines += extra_section(docs)
    from comm_modes import section as comm_modes_section

    lines += comm_modes_section(out)
    if verdicts:
        unquiet = {e["name"]: e["why_not"] for e in (launches or {}).get("launches", [])
                   if not e.get("publishable", True)}
        lines += ["", "## Targets", "",
                  "A ratio is published only when every launch it comes from ran on a quiet machine "
                  "(benchmarks/conditions.py); otherwise its verdict is `unpublished`.", "",
                  "| target | measured | verdict |", "|---|---|---|"]
        refused = []
        for name, value, verdict, *sources in verdicts:
            why = sorted({f"{n}: {unquiet[n]}" for n in (sources[0] if sources else ()) if n in unquiet})
            if why and value is not None:
                verdict = "unpublished"
                refused.append(f"- {name}: {'; '.join(why)}")
            lines.append(f"| {name} | {fmt(value)} | {verdict} |")
        if refused:
            lines += ["", "Unpublished (measured while the machine was not quiet):", ""] + refused
    return "\n".join(lines) + "\n"


def read_launches(out):
    try:
        with open(os.path.join(out, "launches.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def conditions_lines(entries):
    """One row per launch: load before and after, other processes' CPU use, steal."""
    rows = [e for e in entries if e.get("conditions")]
    if not rows:
        return []
    lines = ["", "| launch | s | load before | load after | others (cores) | steal | publishable |",
             "|---|---|---|---|---|---|---|"]
    for e in rows:
        c = e["conditions"]
        lines.append(f"| {e['name']} | {e['seconds']:.0f} | {c['load_before'][0]:.1f} | {c['load_after'][0]:.1f} "
                     f"| {c['foreign_cores']:.2f} | {100 * c['steal_fraction']:.0f}% "
                     f"| {'yes' if e.get('publishable', True) else 'no: ' + e.get('why_not', '')} |")
    return lines


if __name__ == "__main__":
    print(render(sys.argv[1]))
