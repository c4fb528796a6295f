"""The node-local level's files and choices, without MPI: one *part* file per rank and step, holding the rows
of the checkpoint that rank writes to the HDF5 file (its :class:`~.plan.WritePlan` pieces) and the whole
file's description; where the copies go (:func:`partners`); which step a recovery can use (:func:`choose`).

A part file: ``MAGIC``, each piece's bytes, a JSON trailer (steps, ranks, every dataset's path, shape, dtype,
attributes, and this part's region, byte offset and CRC-32), the trailer's length, ``END``. It is written
under a temporary name and renamed, and is taken only with its ``END`` in place, so a rank killed mid-write
leaves nothing that looks complete. Layout: ``<local_dir>/hpctrain-<key>/<node>/step-<step>/part-<rank>.bin``;
``<key>`` names the checkpoint directory, ``<node>`` keeps nodes apart where they share a file system.
"""
import hashlib
import json
import os
import re
import shutil

import numpy as np

from ...runtime import fsutil
from ..content import format as fmt

MAGIC = b"HPCTRAIN-LOCAL1\n"
END = b"HPCTEND1"
TRAILER_LEN = 8
STEP_RE = re.compile(r"^step-(\d{8,})$")
PART_RE = re.compile(r"^part-(\d{5,})\.bin$")
WRITE_BYTES = 1 << 22  # checksummed, NaN-checked and written at a time: still in cache for the write


def base_dir(local_dir, checkpoint_dir):
    """The level's directory for the run whose checkpoints are in ``checkpoint_dir``."""
    key = hashlib.sha1(os.path.abspath(checkpoint_dir).encode()).hexdigest()[:12]
    return os.path.join(local_dir, f"hpctrain-{key}")


def node_dir(base, node):
    return os.path.join(base, node)


JOB_MARK = "slurm-job"  # in a node's directory: the Slurm job that wrote its snapshots last


def mark_job(ndir, job):
    """Note in ``ndir`` that Slurm job ``job`` writes its snapshots (for :func:`clean` by job, from an epilog)."""
    if job:
        os.makedirs(ndir, exist_ok=True)
        with open(os.path.join(ndir, JOB_MARK), "w") as f:
            f.write(f"{job}\n")


def clean(local_dir, node, checkpoint_dir=None, job=None):
    """Remove ``node``'s snapshots under ``local_dir``: those of the run whose checkpoints are in
    ``checkpoint_dir``, or those Slurm job ``job`` wrote; a run's directory goes with its last node. Returns the
    node directories removed."""
    if checkpoint_dir is not None:
        candidates = [node_dir(base_dir(local_dir, checkpoint_dir), node)]
    else:
        try:
            names = sorted(n for n in os.listdir(local_dir) if n.startswith("hpctrain-"))
        except OSError:
            names = []
        candidates = [node_dir(os.path.join(local_dir, n), node) for n in names]
    removed = [ndir for ndir in candidates if os.path.isdir(ndir) and (job is None or _marked_job(ndir) == str(job))]
    for ndir in removed:
        remove_node_dir(ndir)
    return removed


def remove_node_dir(ndir):
    """Remove a node's snapshots; the last node out removes the run's directory."""
    shutil.rmtree(ndir, ignore_errors=True)
    try:
        os.rmdir(os.path.dirname(ndir))
    except OSError:
        pass


def _marked_job(ndir):
    try:
        with open(os.path.join(ndir, JOB_MARK)) as f:
            return f.read().strip()
    except OSError:
        return None


def step_dir(ndir, step):
    return os.path.join(ndir, f"step-{int(step):08d}")


def part_path(ndir, step, owner):
    return os.path.join(step_dir(ndir, step), f"part-{int(owner):05d}.bin")


def partners(nodes):
    """``[rank whose node keeps a copy of rank r's part, or None]`` for ``nodes`` (rank r's node name): the
    rank at the same place among the ranks of the next node (nodes in order of their first rank, cyclic). One
    node: None for all (a copy on the same node survives nothing that the part itself does not)."""
    order = list(dict.fromkeys(nodes))
    if len(order) < 2:
        return [None] * len(nodes)
    members = {n: [r for r, m in enumerate(nodes) if m == n] for n in order}
    dest = []
    for r, n in enumerate(nodes):
        nxt = members[order[(order.index(n) + 1) % len(order)]]
        dest.append(nxt[members[n].index(r) % len(nxt)])
    return dest


# ---------------------------------------------------------------- writing a part

def _plain(value):
    """JSON for attribute values (numpy scalars and arrays as Python ones)."""
    if isinstance(value, (np.generic, np.ndarray)):
        return value.tolist()
    if isinstance(value, bytes):
        return value.decode()
    raise TypeError(f"cannot store {type(value).__name__} in a local checkpoint's description")


def write_part(path, plan, rank, step, nranks, checkpoint_dir, node):
    """Write ``rank``'s pieces of ``plan`` to ``path`` (atomically; ``node``: where ``rank`` runs); returns ``(bytes written, indices of
    datasets marked finite whose piece holds NaN or infinity)``. The checksum, the NaN check and the write
    go through each piece's bytes once."""
    datasets, bad, offset = [], [], len(MAGIC)
    tmp = f"{path}.tmp-{os.getpid()}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            for i, d in enumerate(plan.datasets):
                region = d.region_of(rank) if d.mine is not None else None
                spec = {"path": d.path, "shape": list(d.shape), "dtype": d.dtype.str, "attrs": d.attrs,
                        "finite": bool(d.finite), "region": None if region is None else [list(r) for r in region]}
                if region is not None:
                    flat = np.ascontiguousarray(d.mine).reshape(-1).view(np.uint8)
                    name = d.attrs.get(fmt.DTYPE_ATTR, "")
                    check = d.finite and fmt.can_be_nonfinite(name)
                    crc, ok = 0, True
                    for a in range(0, flat.size, WRITE_BYTES):
                        chunk = flat[a:a + WRITE_BYTES]
                        crc = fmt.crc32(chunk, crc)
                        if check and ok:
                            ok = fmt.all_finite(chunk.view(d.dtype), name)
                        f.write(memoryview(chunk))
                    if not ok:
                        bad.append(i)
                    spec.update(offset=offset, nbytes=int(flat.size), crc=int(crc))
                    offset += flat.size
                datasets.append(spec)
            trailer = json.dumps({"step": int(step), "owner": int(rank), "nranks": int(nranks), "node": node,
                                  "checkpoint_dir": os.path.abspath(checkpoint_dir),
                                  "root_attrs": plan.root_attrs, "group_attrs": plan.group_attrs,
                                  "datasets": datasets}, default=_plain).encode()
            f.write(trailer)
            f.write(len(trailer).to_bytes(TRAILER_LEN, "little"))
            f.write(END)
        os.replace(tmp, path)
    except BaseException:
        fsutil.remove_quietly(tmp)
        raise
    return offset + len(trailer) + TRAILER_LEN + len(END), bad


# ---------------------------------------------------------------- reading parts

class PartDamaged(Exception):
    """A part file that is incomplete or whose bytes do not match its checksums."""


def read_trailer(path):
    """The description of a complete part file; :class:`PartDamaged` if it is not one."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < len(MAGIC) + TRAILER_LEN + len(END) or f.read(len(MAGIC)) != MAGIC:
                raise PartDamaged(f"{path}: not a local checkpoint part")
            f.seek(size - TRAILER_LEN - len(END))
            tail = f.read(TRAILER_LEN + len(END))
            if tail[TRAILER_LEN:] != END:
                raise PartDamaged(f"{path}: incomplete (no end mark)")
            length = int.from_bytes(tail[:TRAILER_LEN], "little")
            start = size - TRAILER_LEN - len(END) - length
            if start < len(MAGIC):
                raise PartDamaged(f"{path}: its description's length is wrong")
            f.seek(start)
            meta = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        raise PartDamaged(f"{path}: {exc}") from exc
    meta["size"] = size
    return meta


def read_data(path, meta):
    """The bytes of the part at ``path`` (described by ``meta``), every piece's checksum verified;
    :class:`PartDamaged` names the first that fails."""
    try:
        data = np.fromfile(path, dtype=np.uint8)
    except OSError as exc:
        raise PartDamaged(f"{path}: {exc}") from exc
    if data.size != meta["size"]:
        raise PartDamaged(f"{path}: changed size while it was read")
    for d in meta["datasets"]:
        if d["region"] is not None:
            raw = data[d["offset"]:d["offset"] + d["nbytes"]]
            if raw.size != d["nbytes"] or fmt.crc32(raw) != d["crc"]:
                raise PartDamaged(f"{path}: the bytes of /{d['path']} do not match their checksum")
    return data


def pieces(meta, data):
    """``[(dataset index, region, uint8 array)]`` of a part's bytes."""
    return [(i, tuple(tuple(r) for r in d["region"]), data[d["offset"]:d["offset"] + d["nbytes"]])
            for i, d in enumerate(meta["datasets"]) if d["region"] is not None]


def scan_node(ndir, checkpoint_dir):
    """``[(step, owner, nranks, path, copy)]`` of the complete part files of one node's directory that belong
    to the run of ``checkpoint_dir``, newest step first (``copy``: written on another node, the owner's, and
    kept here for it); anything else there is left alone."""
    found = []
    for step in steps_on_node(ndir):
        sdir = step_dir(ndir, step)
        try:
            parts = os.listdir(sdir)
        except OSError:
            continue
        for part in parts:
            pm = PART_RE.match(part)
            if not pm:
                continue
            path = os.path.join(sdir, part)
            try:
                meta = read_trailer(path)
            except PartDamaged:
                continue
            if (meta.get("step") == step and meta.get("owner") == int(pm.group(1))
                    and meta.get("checkpoint_dir") == os.path.abspath(checkpoint_dir)):
                copy = meta.get("node") != os.path.basename(os.path.normpath(ndir))
                found.append((meta["step"], meta["owner"], meta["nranks"], path, copy))
    return sorted(found, key=lambda f: (-f[0], f[1]))


def steps_on_node(ndir):
    """The steps with a directory in ``ndir``, oldest first."""
    try:
        names = os.listdir(ndir)
    except OSError:
        return []
    return sorted(int(m.group(1)) for m in map(STEP_RE.match, names) if m)


def remove_steps(ndir, keep):
    """Remove the step directories of ``ndir`` for which ``keep(step)`` is false."""
    for step in steps_on_node(ndir):
        if not keep(step):
            shutil.rmtree(step_dir(ndir, step), ignore_errors=True)


# ---------------------------------------------------------------- which step a recovery takes

def choose(found, newer_than, damaged=()):
    """The newest step after ``newer_than`` (the newest checkpoint file's step, 0 for none) whose parts all
    exist somewhere.
    ``found``: ``{rank: [(step, owner, nranks, path, copy)]}``, what each rank sees on its node. Returns
    ``(step, {owner: (holder rank, path, copy)}, skipped)``, ``step`` None when no step qualifies; ``skipped``:
    ``[(step, owners missing)]`` of newer steps that were incomplete. Each part is read by the rank holding it
    that has the fewest to read already (parts spread over the nodes that survived). A part whose path is in
    ``damaged`` (found so by an earlier try) counts as missing: its copy, or an older step, is taken instead."""
    by_step = {}
    for rank in sorted(found):
        for step, owner, nranks, path, copy in found[rank]:
            if step > newer_than and path not in damaged:
                by_step.setdefault((step, nranks), {}).setdefault(owner, []).append((rank, path, copy))
    skipped = []
    for step, nranks in sorted(by_step, reverse=True):
        holders = by_step[(step, nranks)]
        missing = [o for o in range(nranks) if o not in holders]
        if missing:
            skipped.append((step, missing))
            continue
        load, chosen = {}, {}
        for owner in range(nranks):
            rank, path, copy = min(holders[owner], key=lambda h: (load.get(h[0], 0), h[2], h[0]))
            load[rank] = load.get(rank, 0) + 1
            chosen[owner] = (rank, path, copy)
        return step, chosen, skipped
    return None, {}, skipped
