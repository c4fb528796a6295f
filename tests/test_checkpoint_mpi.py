"""Checkpoints under a real mpirun with parallel HDF5: round trips across rank counts,
bitwise resume, retention, failures on one rank, damaged files, serial fallback, async."""
import os
import shutil
import subprocess
import sys
import uuid

import pytest

from assertions import ranks_say
from mpi_harness import ROOT, command, mpirun
from system_packages import install_debian

pytestmark = pytest.mark.mpi

SCRIPTS = ROOT / "tests" / "mpi"
TIMEOUT = 150


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint written by 2 ranks in parallel, with a torch.save reference beside it."""
    d = tmp_path_factory.mktemp("saved")
    result = mpirun(2, [SCRIPTS / "ckpt_roundtrip.py", "save", d], timeout=TIMEOUT).check()
    ranks_say(result, "SAVED", 2)
    return d


@pytest.mark.parametrize("n", [1, 2, 4])
def test_save_on_2_load_on_n(saved, n):
    result = mpirun(n, [SCRIPTS / "ckpt_roundtrip.py", "load", saved], timeout=TIMEOUT).check()
    ranks_say(result, f"LOADED OK of {n}", n)


def test_file_is_plain_hdf5(saved):
    path = saved / "checkpoints" / "ckpt-00000002.h5"
    assert (saved / "checkpoints" / "latest").read_text() == "ckpt-00000002.h5\n"
    if shutil.which("h5ls"):
        listing = subprocess.run(["h5ls", "-r", str(path)], capture_output=True, text=True, timeout=60).stdout
        assert "/model/embed.weight      Dataset {320, 1024}" in listing
        assert "/optimizer/state/embed.weight/exp_avg_sq" in listing
    if shutil.which("h5dump"):
        out = subprocess.run(["h5dump", "-a", "/model/scale/dtype", str(path)], capture_output=True, text=True,
                             timeout=60).stdout
        assert '"bfloat16"' in out
    # plain serial h5py, no hpctrain: every stored checksum is zlib.crc32 of the bytes
    code = ("import h5py, zlib, sys\n"
            "f = h5py.File(sys.argv[1], 'r')\n"
            "bad = []\n"
            "f.visititems(lambda n, o: bad.append(n) if isinstance(o, h5py.Dataset) and "
            "zlib.crc32(o[()].tobytes()) != int(o.attrs['crc32']) else None)\n"
            "assert not bad, bad\n"
            "assert f.attrs['format_version'] == 2 and f.attrs['nranks'] == 2 and f.attrs['io_mode'] == 'mpio'\n"
            "print('plain ok')\n")
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60,
                         cwd="/")
    assert "plain ok" in out.stdout, out.stderr


def test_cli_list_inspect_verify_export(saved, tmp_path):
    from hpctrain.commands.ckpt import main

    path = str(saved / "checkpoints" / "ckpt-00000002.h5")
    assert main(["list", str(saved)]) == 0
    assert main(["inspect", path]) == 0
    assert main(["verify", path]) == 0
    out = tmp_path / "model.pt"
    assert main(["export", path, "--to", str(out)]) == 0
    import torch

    exported = torch.load(out)
    ref = torch.load(saved / "ref.pt", weights_only=False)["model"]
    assert list(exported) == list(ref)
    assert all(torch.equal(exported[k], ref[k]) and exported[k].dtype == ref[k].dtype for k in ref)
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    assert main(["export", path, "--to", str(tmp_path / "model.safetensors")]) == 0
    st = load_file(str(tmp_path / "model.safetensors"))
    assert all(torch.equal(st[k], ref[k]) for k in ref)


def test_cli_verify_names_damaged_dataset(saved, tmp_path):
    import h5py

    bad = tmp_path / "bad.h5"
    shutil.copy(saved / "checkpoints" / "ckpt-00000002.h5", bad)
    with h5py.File(bad, "r") as f:
        offset = f["model/fc2.weight"].id.get_offset()
    with open(bad, "r+b") as f:
        f.seek(offset + 3)
        f.write(b"\x55")
    proc = command("ckpt", "verify", bad)
    assert proc.returncode == 1
    assert "/model/fc2.weight: checksum mismatch" in proc.stderr


def test_serial_fallback_writes_the_same_format(tmp_path):
    env = {"HPCTRAIN_CKPT_SERIAL": "1"}
    save = mpirun(2, [SCRIPTS / "ckpt_roundtrip.py", "save", tmp_path], env=env, timeout=TIMEOUT).check()
    assert "rank 0 writes and reads checkpoints alone" in save.stderr
    import h5py

    with h5py.File(tmp_path / "checkpoints" / "ckpt-00000002.h5", "r") as f:
        assert f.attrs["io_mode"] == "serial" and f.attrs["nwriters"] == 1
    # read back in parallel, and serially
    for load_env in (None, env):
        load = mpirun(2, [SCRIPTS / "ckpt_roundtrip.py", "load", tmp_path], env=load_env, timeout=TIMEOUT).check()
        ranks_say(load, "LOADED OK", 2)


def test_more_ranks_than_tensors(tmp_path):
    for mode, text in (("save", "SAVED"), ("load", "LOADED OK of 4")):
        result = mpirun(4, [SCRIPTS / "ckpt_roundtrip.py", mode, tmp_path, "--tiny"], timeout=TIMEOUT).check()
        ranks_say(result, text, 4)


@pytest.mark.parametrize("async_save", [pytest.param("0", marks=pytest.mark.smoke), "1"])
def test_resume_is_bitwise_identical_to_uninterrupted(tmp_path, async_save):
    import torch

    sys.path.insert(0, str(SCRIPTS))
    import ckpt_common as cc

    script = SCRIPTS / "ckpt_train.py"
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    mpirun(2, [script, whole, 6], timeout=TIMEOUT).check()
    first = mpirun(2, [script, parts, 3, "every_steps=3", f"async_save={async_save}"], timeout=TIMEOUT).check()
    ranks_say(first, "saved ckpt-00000003.h5", 2)
    second = mpirun(2, [script, parts, 6, "resume=auto"], timeout=TIMEOUT).check()
    ranks_say(second, "resumed=True at step 3", 2)
    a = torch.load(whole / "final.pt", weights_only=False)
    b = torch.load(parts / "final.pt", weights_only=False)
    cc._same(a["model"], b["model"], "model")
    cc._same(a["optimizer"], b["optimizer"], "optimizer")
    assert a["progress"] == b["progress"]


SCENARIOS = ["retention", "latest_failure", "async_failure", "async_same", "corrupt_fallback", "truncated", "missing_dataset",
             "wrong_version", "shape_mismatch", "groups_mismatch", "in_place", "unwritable", "consistency"]


def test_scenarios(tmp_path):
    result = mpirun(2, [SCRIPTS / "ckpt_scenarios.py", tmp_path, *SCENARIOS], timeout=TIMEOUT).check()
    for name in SCENARIOS:
        ranks_say(result, f"{name} OK", 2)
    for name in ["latest_failure", "async_failure", "corrupt_fallback", "truncated", "missing_dataset", "wrong_version",
                 "shape_mismatch", "groups_mismatch", "unwritable", "consistency"]:
        ranks_say(result, f"{name} ERROR: ", 2)
    assert "skipping checkpoint" in result.stderr and "/model/fc1.weight" in result.stderr
    assert "copying rank 0's to every rank" in result.stderr
    # mpirun binds each of 2 ranks to one core: an async save is told it has none to spare.
    assert "checkpoint.async_save: this rank may run on one core only" in result.stderr


def _mount_tmpfs(path, options):
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True,
                          text=True, timeout=30)
    return proc.returncode == 0


def test_disk_full_and_read_only_file_systems(tmp_path):
    full, ro = tmp_path / f"full-{uuid.uuid4().hex[:6]}", tmp_path / "ro"
    if not _mount_tmpfs(full, "size=6M"):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected one-rank failure "
                    "in test_scenarios covers the write-failure path")
    try:
        mounted_ro = _mount_tmpfs(ro, "ro,size=1M")
        args = [SCRIPTS / "ckpt_scenarios.py", tmp_path, "disk_full", "unwritable", "--tmpfs", full]
        if mounted_ro:
            args += ["--ro", ro]
        result = mpirun(2, args, timeout=TIMEOUT).check()
        ranks_say(result, "disk_full ERROR: ", 2)
        ranks_say(result, "disk_full OK", 2)
        ranks_say(result, "unwritable OK", 2)
        assert "No space left on device" in result.stdout
    finally:
        subprocess.run(["umount", str(full)], timeout=30)
        subprocess.run(["umount", str(ro)], timeout=30, capture_output=True)


def test_disk_full_on_ext4_while_parts_are_mapped(tmp_path):
    """A real full ext4 (8 MiB, mounted from an image): each rank's parts go through a shared mapping of the
    file there, so the disk fills while a part's space is allocated. Every rank reports errno 28 (no rank dies
    of SIGBUS), the temp file is gone and the previous checkpoint stays valid and `latest`."""
    if shutil.which("mkfs.ext4") is None and os.geteuid() == 0:
        install_debian("e2fsprogs")
    image, mount = tmp_path / "ext4.img", tmp_path / f"ext4-{uuid.uuid4().hex[:6]}"
    with open(image, "wb") as f:
        f.truncate(8 << 20)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", str(image)],
                          capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    os.makedirs(mount)
    mounted = subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True, text=True,
                             timeout=30)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an ext4 image here (needs root and a loop device): {mounted.stderr.strip()}")
    try:
        result = mpirun(2, [SCRIPTS / "ckpt_scenarios.py", tmp_path, "disk_full_mapped", "--tmpfs", mount],
                        timeout=TIMEOUT).check()
        ranks_say(result, "disk_full_mapped ERROR: ", 2)
        ranks_say(result, "disk_full_mapped OK", 2)
    finally:
        subprocess.run(["umount", str(mount)], timeout=30)


def test_corrupt_file_fails_the_job_on_every_rank(tmp_path):
    result = mpirun(2, [SCRIPTS / "ckpt_scenarios.py", tmp_path, "exit_corrupt"], timeout=TIMEOUT, fresh=True)
    assert result.returncode != 0
    ranks_say(result, "exit_corrupt ERROR: ", 2)
    assert "/optimizer/state/embed.weight/exp_avg" in result.stdout
    assert "hpctrain: error:" in result.stderr and "NO ERROR" not in result.stdout


def test_a_save_and_a_resume_walk_the_checkpoint_modules_downward_only(tmp_path):
    """Traced on real saves (foreground and the writer thread) and a resume: a checkpoint module
    calls only the modules below it (those it imports, directly or through others), never back
    up into its caller's module, and a save goes through the whole pipeline."""
    from test_structure import _imports, _modules, _name

    below = {}  # module -> the checkpoint modules it imports, directly or not
    direct = {_name(p): {t for t, _ in _imports(p) if t.startswith("hpctrain.checkpoint")} for p in _modules()}

    def reach(m, seen):
        for t in direct.get(m, ()):
            if t not in seen:
                seen.add(t)
                reach(t, seen)
        return seen

    for m in direct:
        below[m] = reach(m, set())
    out = mpirun(2, [ROOT / "tests" / "mpi" / "checkpoint_walk.py", tmp_path], timeout=120, check=True).stdout
    edges = [line.split()[1:] for line in out.splitlines() if line.startswith("EDGE ")]
    assert edges, out
    upward = [f"{a} -> {b}" for a, b in edges if b not in below.get(a, ())]
    assert not upward, "calls that do not go down the checkpoint package's layers:\n" + "\n".join(upward)
    (entered,) = [line.split()[1:] for line in out.splitlines() if line.startswith("ENTERED ")]
    for module in ("manager", "policy", "replicated", "commit", "directory", "metadata", "snapshot", "plan",
                   "writer", "h5file", "agreement", "reader", "background"):
        assert module in entered, (module, entered)
