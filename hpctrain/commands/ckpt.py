"""``hpctrain ckpt``: list, inspect, verify and export checkpoints, in one process (no MPI).

    hpctrain ckpt list RUN_DIR_OR_CKPT_DIR      step, time, size, metrics, valid; abandoned branches
    hpctrain ckpt inspect FILE                  metadata, trainer state, every dataset
    hpctrain ckpt verify FILE                   exit 1 and name the dataset on corruption
    hpctrain ckpt export FILE --to OUT.pt       a plain torch state dict (or .safetensors)
    hpctrain ckpt export FILE --to DIR --format hf    a transformers model's from_pretrained directory
    hpctrain ckpt clean-local RUN_DIR | --job JOBID     this node's node-local snapshots (a Slurm epilog)
"""
import argparse
import contextlib
import json
import os
import sys

from ..checkpoint.content import format as fmt
from ..errors import CheckpointError, HpctrainError


def _checkpoint_dir(path):
    sub = os.path.join(path, "checkpoints")
    return sub if os.path.isdir(sub) and not any(fmt.parse_step(n) is not None for n in os.listdir(path)) else path


def _size(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024


def _rows(directory, found, latest, quick):
    from ..checkpoint.io.reader import read_header, verify_file

    for step, name in sorted(found):
        path = os.path.join(directory, name)
        created, metrics = "?", ""
        with contextlib.suppress(CheckpointError):
            h = read_header(path)
            created = h.root_attrs.get("created", "?")
            metrics = json.dumps(h.metrics, sort_keys=True) if h.metrics else ""
        problems = [] if quick else verify_file(path)
        # a diverged run's file is complete but worthless: say which
        valid = ("?" if quick else "yes" if not problems else
                 "NaN" if all("non-finite" in p for p in problems) else "NO")
        mark = "* " if name == latest else "  "
        print(f"{mark}{step:>10}  {created:20}  {_size(os.path.getsize(path)):>10}  {valid:5}  {metrics}")
        for p in problems[:3]:
            print(f"{'':14}{p}")


def _abandoned(directory):
    """``[(folder, record or {}, [(step, name)])]`` of the abandoned branches, oldest first."""
    from ..checkpoint.directory import BRANCH_RECORD, scan

    root = os.path.join(directory, fmt.ABANDONED)
    out = []
    for sub in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        folder = os.path.join(root, sub)
        if not os.path.isdir(folder):
            continue
        try:
            with open(os.path.join(folder, BRANCH_RECORD)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            record = {}
        out.append((folder, record, scan(folder)))
    return out


def cmd_list(args):
    from ..checkpoint.directory import read_latest, scan

    directory = _checkpoint_dir(args.directory)
    if not os.path.isdir(directory):
        print(f"hpctrain ckpt: {args.directory} is not a directory", file=sys.stderr)
        return 2
    found = scan(directory)
    branches = _abandoned(directory)
    if not found and not branches:
        print(f"no checkpoints in {directory}")
        return 0
    latest = read_latest(directory)
    print(f"{directory}")
    print(f"{'':2}{'step':>10}  {'created (UTC)':20}  {'size':>10}  {'valid':5}  metrics")
    _rows(directory, found, latest, args.quick)
    print("(* = latest)")
    for folder, record, files in branches:
        print(f"ABANDONED branch {os.path.relpath(folder, directory)}: the run went on from step "
              f"{record.get('resumed_step', '?')} ({os.path.basename(str(record.get('resumed_from', '?')))}) "
              f"on {record.get('abandoned', '?')}; never resumed automatically, never deleted by retention")
        _rows(folder, files, None, args.quick)
    return 0


def cmd_inspect(args):
    from ..checkpoint.io.reader import read_header

    h = read_header(args.file)
    print(f"{args.file}")
    for key in sorted(set(h.root_attrs) - {"datasets"}):
        print(f"  {key}: {h.root_attrs[key]}")
    trainer = h.group_attrs.get(fmt.TRAINER, {})
    print("trainer:")
    for key in sorted(trainer):
        print(f"  {key}: {trainer[key]}")
    opt = h.group_attrs.get(fmt.OPTIMIZER, {})
    print(f"optimizer: {opt.get('class', '?')}")
    if args.verbose:
        print(f"  param_groups: {opt.get('param_groups')}")
    print(f"datasets ({len(h.datasets)}):")
    total = 0
    for name, (shape, dtype, attrs) in sorted(h.datasets.items()):
        import numpy as np

        nbytes = fmt.nbytes_of(shape, np.dtype(dtype).itemsize)
        total += nbytes
        print(f"  /{name}  {list(shape)}  {attrs.get(fmt.DTYPE_ATTR)}  {_size(nbytes)}  crc32={int(attrs[fmt.CRC_ATTR]):08x}")
    print(f"total {_size(total)} in {len(h.datasets)} datasets")
    return 0


def cmd_verify(args):
    from ..checkpoint.io.reader import verify_file

    problems = verify_file(args.file)
    if problems:
        print(f"{args.file}: INVALID", *(f"  {p}" for p in problems), sep="\n", file=sys.stderr)
        return 1
    print(f"{args.file}: ok")
    return 0


def model_state_dict(path):
    """The model tensors of checkpoint ``path`` as ``{name: torch.Tensor}`` (verified)."""
    import h5py

    from ..checkpoint.io.reader import read_header, verify_file
    from ..checkpoint.content.snapshot import array_to_tensor

    problems = verify_file(path)
    if problems:
        raise CheckpointError(f"{path} is damaged: " + "; ".join(problems[:5]))
    h = read_header(path)
    out = {}
    with h5py.File(path, "r") as f:
        for name, (_, _, attrs) in h.datasets.items():
            if name.startswith(fmt.MODEL + "/"):
                out[fmt.param_name(name.split("/", 1)[1])] = array_to_tensor(f[name][()], attrs[fmt.DTYPE_ATTR])
    order = fmt.from_json(h.root_attrs.get("datasets", "[]"), "/ datasets")
    rank = {fmt.param_name(p.split("/", 1)[1]): i for i, p in enumerate(order) if p.startswith(fmt.MODEL + "/")}
    return dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], 0)))


def cmd_export(args):
    out, how = args.to, args.format or ("safetensors" if args.to.endswith(".safetensors") else "torch")
    problem = _unwritable_output(out, how)
    if problem:  # said before the checkpoint is read
        return _export_error(out, problem)
    sd = model_state_dict(args.file)
    try:
        if how == "hf":
            return _export_pretrained(args.file, sd, out)
        if how == "safetensors":
            try:
                from safetensors.torch import save_file
            except ImportError:
                print("hpctrain ckpt: exporting .safetensors needs the safetensors package "
                      "(pip install safetensors); use a .pt path for a torch state dict", file=sys.stderr)
                return 2
            save_file({k: v.contiguous() for k, v in sd.items()}, out, metadata={"source": os.path.basename(args.file)})
        else:
            import torch

            torch.save(sd, out)
    except OSError as exc:  # a full disk or quota, or a path changed since the checks
        return _export_error(out, f"{exc.strerror or exc}; give --to a path you can write to, with room for it")
    print(f"wrote {len(sd)} tensors to {out}")
    return 0


def _unwritable_output(out, how):
    """Why ``out`` cannot be written as format ``how`` and what to do (one line), or None."""
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.exists(parent):
        return (f"the directory {parent} does not exist; create it first (mkdir -p {parent}), or give --to a path "
                "in an existing directory")
    if not os.path.isdir(parent):
        return f"{parent} is a file, not a directory; give --to a path in a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"the directory {parent} is not writable by this user; give --to a path in one you can write to"
    if how == "hf" and os.path.isfile(out):
        return "it is a file, and --format hf writes a directory; give --to a new or existing directory"
    if how != "hf" and os.path.isdir(out):
        return "it is a directory; give --to a file path (.pt, .safetensors), or --format hf to write a directory"
    return None


def _export_error(out, text):
    print(f"hpctrain ckpt: error: cannot write {out}: {text}", file=sys.stderr)
    return 2


EXPORT_FORMATS = ("torch", "safetensors", "hf")


def _export_pretrained(path, sd, out):
    """``--format hf``: the run's model rebuilt from the ``[model]`` its checkpoint records, given the weights,
    and written with ``save_pretrained`` (loads with ``AutoModel*.from_pretrained(out)``)."""
    from ..checkpoint.io.reader import read_header
    from ..config import TrainConfig
    from ..config.usercode import make_importable
    from ..models.huggingface import save_pretrained

    recorded = fmt.from_json(read_header(path).root_attrs.get("run_config", "{}"), "/ run_config")
    cfg = TrainConfig.from_dict({"model": recorded.get("model", {})}, source=f"{path}'s run_config")
    make_importable(recorded.get("run", {}).get("python_path", []))
    try:
        model = save_pretrained(sd, cfg.model, out)
    except HpctrainError as exc:
        print(f"hpctrain ckpt: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {type(model).__name__} ({len(sd)} tensors) to {out}/: load it with "
          f"transformers' {type(model).__name__}.from_pretrained({out!r})")
    return 0


def cmd_clean_local(args):
    """This node's node-local snapshots of a run (or of a Slurm job, from an epilog) removed."""
    from ..checkpoint.local import files
    from ..runtime.world import node_name

    if (args.directory is None) == (args.job is None):
        print("hpctrain ckpt clean-local: error: name a run directory or --job JOBID (one of them)\n"
              "HINT: a Slurm epilog runs `hpctrain ckpt clean-local --job $SLURM_JOB_ID`", file=sys.stderr)
        return 2
    if not os.path.isdir(args.local_dir):
        print(f"hpctrain ckpt clean-local: error: --local-dir {args.local_dir} is not a directory\n"
              "HINT: name the runs' checkpoint.local_dir (default /dev/shm)", file=sys.stderr)
        return 2
    node = node_name()
    checkpoint_dir = None if args.directory is None else _checkpoint_dir(args.directory)
    removed = files.clean(args.local_dir, node, checkpoint_dir=checkpoint_dir, job=args.job)
    what = f"of {checkpoint_dir}" if args.job is None else f"of Slurm job {args.job}"
    dirs = "directory" if len(removed) == 1 else "directories"
    print(f"hpctrain ckpt clean-local: {len(removed)} node-local snapshot {dirs} {what} removed on {node}"
          + "".join(f"\n  {d}" for d in removed))
    return 0


def build_parser():
    parser = argparse.ArgumentParser(prog="hpctrain ckpt", description="Work with hpctrain checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    p = sub.add_parser("list", help="checkpoints of a run: step, time, size, metrics, valid")
    p.add_argument("directory", help="a run directory or its checkpoints/ directory")
    p.add_argument("--quick", action="store_true", help="skip checksum verification")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("inspect", help="metadata, trainer state and datasets of one checkpoint")
    p.add_argument("file")
    p.add_argument("-v", "--verbose", action="store_true", help="also print the optimizer's param groups")
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("verify", help="check every checksum; exit 1 naming a damaged dataset")
    p.add_argument("file")
    p.set_defaults(func=cmd_verify)
    p = sub.add_parser("export", help="write the model as a torch state dict (.pt), .safetensors, or a "
                                      "Hugging Face from_pretrained directory (--format hf)")
    p.add_argument("file")
    p.add_argument("--to", required=True, help="output path ending in .pt or .safetensors; a directory with --format hf")
    p.add_argument("--format", choices=EXPORT_FORMATS, default=None,
                   help="default: from the path (.safetensors, else torch); hf: the run's transformers model's "
                        "save_pretrained directory (config.json, model.safetensors)")
    p.set_defaults(func=cmd_export)
    p = sub.add_parser("clean-local", help="remove this node's node-local snapshots of a run, or of a Slurm job "
                                           "(from an epilog: --job $SLURM_JOB_ID)")
    p.add_argument("directory", nargs="?", help="a run directory or its checkpoints/ directory")
    p.add_argument("--job", help="every snapshot on this node that Slurm job JOBID wrote")
    p.add_argument("--local-dir", default="/dev/shm", help="the runs' checkpoint.local_dir (default /dev/shm)")
    p.set_defaults(func=cmd_clean_local)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CheckpointError as exc:
        print(f"hpctrain ckpt: error: {exc}", file=sys.stderr)
        return 1
