"""A model, not a measurement: checkpoint save time and checkpoint overhead at 64 to 4096 nodes, for one shared
HDF5 file (packed, as before the aligned layout, and aligned), one file per node, and with the node-local level.

    python benchmarks/scale_model.py            # the markdown table of docs/performance.md ("At scale")
    python benchmarks/scale_model.py --state-gb 300 --fs-gbps 400

Every figure follows from ``ASSUMPTIONS`` (each says where it comes from: measured here, published, or
assumed) through these formulas, for a state of S bytes on N nodes:

- a collective save: ``t_file(N) + S / min(e x B_fs, N x b_node) + S / (N x b_verify)``, where e is the
  fraction of the file system's bandwidth a shared file gets (packed or aligned), ``t_file(N)`` the fixed cost
  of one file (create, metadata, close, rename, fsync, the collective calls), growing with log2(ranks) as
  measured here between 2 and 32 ranks, and the last term the verification re-read from the page cache;
- one file per node: the same with e = 1, plus N file creates at the metadata server's rate (and a
  directory of N files per checkpoint to keep, list and remove);
- the node-local level: each node copies its 1/N of the state to memory and to its partner over the network:
  ``(S / N) / b_mem + (S / N) / b_net``;
- the overhead: with the job's mean time between failures M = node MTBF / N and a save costing C (what
  training waits for), Young's interval sqrt(2 C M) costs about sqrt(2 C / M) of the wall time; with the local
  level, a fraction p of failures (one node) recovers from it and the rest from the file, and each level's
  term adds: sqrt(2 C_local p / M) + sqrt(2 C_file (1 - p) / M).
"""
import argparse
import math

ASSUMPTIONS = {
    "state_gb": 84.0,  # assumed: 7e9 parameters in fp32 with AdamW's two moments (12 bytes a parameter)
    "fs_gbps": 100.0,  # assumed: what the job gets of the parallel file system's write bandwidth
    "node_gbps": 5.0,  # assumed: one node's client write bandwidth to it
    "verify_gbps": 5.0,  # measured here: 0.10 s to re-read and checksum 1.07 GiB on 2 ranks (section 3)
    "shared_packed": 0.40,  # published: h5py's mpio driver at 39-41% of file-per-process (h5py pull request 2227)
    "shared_aligned": 0.80,  # assumed: aligned regions remove the lock contention the packed layout suffers
    "file_s_2": 0.15,  # measured here: median save of the digits example on 2 ranks (its fixed costs)
    "file_s_32": 0.35,  # measured here: the same on 32 ranks (oversubscribed: an upper bound)
    "ranks_per_node": 4,  # assumed: 4 GPUs a node
    "creates_per_s": 20000.0,  # assumed: the metadata server's file creates a second
    "mem_gbps": 10.0,  # assumed: a node's copy into /dev/shm
    "net_gbps": 12.0,  # assumed: 100 Gb/s to the partner node
    "node_mtbf_years": 5.0,  # assumed: as benchmarks/interval_model.py
    "one_node_fraction": 0.9,  # assumed: failures that take at most one node (the local level recovers them)
}
NODES = (64, 256, 1024, 4096)
YEAR = 365.0 * 86400.0


def file_seconds(ranks, a):
    """Fixed cost of one collective file on ``ranks`` ranks: the measured 2- and 32-rank points, log-linear."""
    per_doubling = (a["file_s_32"] - a["file_s_2"]) / math.log2(32 / 2)
    return a["file_s_2"] + per_doubling * max(0.0, math.log2(ranks / 2))


def save_seconds(nodes, a, share):
    s = a["state_gb"]
    bandwidth = min(share * a["fs_gbps"], nodes * a["node_gbps"])
    return (file_seconds(nodes * a["ranks_per_node"], a) + s / bandwidth
            + s / (nodes * a["ranks_per_node"] * a["verify_gbps"]))


def per_node_seconds(nodes, a):
    s = a["state_gb"]
    return (file_seconds(a["ranks_per_node"], a) + s / min(a["fs_gbps"], nodes * a["node_gbps"])
            + nodes / a["creates_per_s"] + s / (nodes * a["ranks_per_node"] * a["verify_gbps"]))


def local_seconds(nodes, a):
    part = a["state_gb"] / nodes
    return part / a["mem_gbps"] + part / a["net_gbps"]


def overhead(cost, rate):
    """Young's interval's share of the wall time for saves costing ``cost`` against failures at ``rate``."""
    return math.sqrt(2.0 * cost * rate)


def rows(a):
    out = []
    for n in NODES:
        mtbf = a["node_mtbf_years"] * YEAR / n
        packed, aligned = save_seconds(n, a, a["shared_packed"]), save_seconds(n, a, a["shared_aligned"])
        per_node, local = per_node_seconds(n, a), local_seconds(n, a)
        p = a["one_node_fraction"]
        out.append({
            "nodes": n, "mtbf_h": mtbf / 3600.0, "packed_s": packed, "aligned_s": aligned, "per_node_s": per_node,
            "local_s": local, "ovh_packed": overhead(packed, 1 / mtbf), "ovh_aligned": overhead(aligned, 1 / mtbf),
            "ovh_local": overhead(local, p / mtbf) + overhead(aligned, (1 - p) / mtbf),
        })
    return out


def table(a):
    lines = ["| nodes | job MTBF h | save: shared, packed s | shared, aligned s | file per node s | node-local s "
             "| overhead: packed | aligned | aligned + node-local |", "|" + "---|" * 9]
    for r in rows(a):
        lines.append(f"| {r['nodes']} | {r['mtbf_h']:.1f} | {r['packed_s']:.2f} | {r['aligned_s']:.2f} | "
                     f"{r['per_node_s']:.2f} | {r['local_s']:.3f} | {100 * r['ovh_packed']:.1f}% | "
                     f"{100 * r['ovh_aligned']:.1f}% | {100 * r['ovh_local']:.1f}% |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for key, value in ASSUMPTIONS.items():
        parser.add_argument("--" + key.replace("_", "-"), type=type(value), default=value)
    args = vars(parser.parse_args())
    print(table(args))


if __name__ == "__main__":
    main()
