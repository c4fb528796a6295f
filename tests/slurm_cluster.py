"""A real Slurm cluster for the tests: started with scripts/slurm-cluster.sh under a
temporary directory, used through the real sbatch/srun/scontrol/scancel, stopped afterwards.
Every command has a timeout; every wait for a job has a deadline.

One node (:class:`SlurmCluster`) is this machine; several (:class:`MultiNodeCluster`) are
nodes n1..nN in network namespaces of this machine, sharing its filesystem, which a test can
kill or cut off the network.
"""
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from mpi_harness import ROOT, mpi_env

SCRIPT = ROOT / "scripts" / "slurm-cluster.sh"
# States after which a job will not run again by itself.
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# Seconds a requeued job is left pending before the tests let it start (see wait()).
REQUEUE_SETTLE = 8


class SlurmUnavailable(Exception):
    """Slurm could not be installed or started here; the reason says which."""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parse_record(text):
    """``Key=Value Key=Value ...`` (one line of ``scontrol -o`` or jobcomp/filetxt) -> dict."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


class SlurmCluster:
    nodes = 1

    def __init__(self, directory):
        self.directory = Path(directory)
        self.conf = self.directory / "slurm.conf"
        self.ports = {"SLURM_CTLD_PORT": str(_free_port()), "SLURMD_PORT": str(_free_port())}

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def start(cls, directory, timeout=420, **options):
        if os.geteuid() != 0:
            raise SlurmUnavailable("needs root to run slurmd (it starts jobs as their owner)")
        cluster = cls(directory, **options)
        try:
            proc = cluster._script_start(timeout)
        except subprocess.TimeoutExpired:
            cluster.stop()
            raise SlurmUnavailable(f"{SCRIPT.name} start did not finish in {timeout}s")
        if proc.returncode != 0:
            cluster.stop()
            raise SlurmUnavailable(f"{SCRIPT.name} start failed: {proc.stderr.strip()[-2000:]}")
        return cluster

    def _script_start(self, timeout):
        """``slurm-cluster.sh start``: starts what is not running (the same ports each time)."""
        nodes = ["--nodes", str(self.nodes)] if self.nodes > 1 else []
        return subprocess.run(["bash", str(SCRIPT), "start", *nodes, str(self.directory)], capture_output=True,
                              text=True, timeout=timeout, env=dict(os.environ, **self.ports))

    def stop(self):
        subprocess.run(["bash", str(SCRIPT), "stop", str(self.directory)], capture_output=True,
                       text=True, timeout=120)

    # ------------------------------------------------------------------ commands
    def env(self, extra=None):
        """The environment for Slurm commands; jobs inherit it (sbatch exports it), so it
        carries the Open MPI settings this machine needs (root, oversubscription, loopback)."""
        env = mpi_env(extra)
        env["SLURM_CONF"] = str(self.conf)
        for name in [n for n in env if n.startswith(("SLURM_JOB", "SLURM_STEP", "SLURM_ARRAY"))]:
            env.pop(name)  # never look like we are inside a job ourselves
        return env

    def run(self, args, timeout=60, env=None, check=True, cwd=None):
        proc = subprocess.run([str(a) for a in args], capture_output=True, text=True,
                              timeout=timeout, env=env or self.env(), cwd=cwd or ROOT)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(map(str, args))} exited {proc.returncode}:\n"
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return proc

    def sbatch(self, script, *args, options=(), env=None, cwd=None):
        """Submit ``script`` with ``sbatch --parsable OPTIONS script ARGS``; returns the job id."""
        proc = self.run(["sbatch", "--parsable", *options, script, *args], env=env, cwd=cwd)
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id):
        """``scontrol show job`` as a dict (``{}`` once the controller forgot the job)."""
        proc = self.run(["scontrol", "-o", "show", "job", job_id], check=False, timeout=30)
        if proc.returncode != 0 or not proc.stdout.strip():
            return {}
        return _parse_record(proc.stdout.splitlines()[0])

    def jobs(self, job_id):
        """Every job record (one per array task) for ``job_id``."""
        proc = self.run(["scontrol", "-o", "show", "job", job_id], check=False, timeout=30)
        return [_parse_record(line) for line in proc.stdout.splitlines() if line.strip()]

    def completions(self, job_id):
        """jobcomp/filetxt lines for ``job_id``: one per end of the job (also per requeue)."""
        path = self.directory / "log" / "jobcomp.txt"
        if not path.exists():
            return []
        records = [_parse_record(line) for line in path.read_text().splitlines()]
        return [r for r in records if r.get("JobId") == str(job_id)]

    def wait(self, job_id, timeout=300, poll=0.25):
        """Wait until every task of ``job_id`` is in a final state; returns their records.

        A requeued job passes through REQUEUED/PENDING and runs again, so those states are
        not final. Fails the test (after cancelling the job) on timeout."""
        deadline = time.monotonic() + timeout
        records, held_since = [], {}
        while time.monotonic() < deadline:
            records = self.jobs(job_id)
            if records and all(r.get("JobState") in FINAL_STATES for r in records):
                return records
            for r in records:
                # Slurm holds a requeued job back for about two minutes (EligibleTime =
                # requeue time + 121 s) while the old run's credential and steps are cleaned
                # up. A test need not wait that out, but restarting within a second or two
                # fails ("Job credential revoked"), so give the cleanup a few seconds.
                if r.get("JobState") == "PENDING" and r.get("Reason") == "BeginTime":
                    since = held_since.setdefault((r["JobId"], r.get("Restarts")), time.monotonic())
                    if time.monotonic() - since >= REQUEUE_SETTLE:
                        self.run(["scontrol", "update", f"JobId={r['JobId']}", "StartTime=now"], check=False)
            time.sleep(poll)
        self.run(["scancel", job_id], check=False)
        raise AssertionError(f"Slurm job {job_id} did not finish in {timeout}s: "
                             f"{[(r.get('JobId'), r.get('JobState'), r.get('Reason')) for r in records]}\n"
                             f"{self.job_output_tail(records)}{self.log_tail()}")

    @staticmethod
    def job_output_tail(records, chars=6000):
        """The end of each job's output file (where a hung job's own words are)."""
        said = []
        for path in sorted({r.get("StdOut") for r in records if r.get("StdOut")}):
            try:
                said.append(f"--- {path}\n{Path(path).read_text(errors='replace')[-chars:]}")
            except OSError as exc:
                said.append(f"--- {path}: {exc}")
        return "".join(s + "\n" for s in said)

    def wait_for(self, predicate, timeout, what, poll=0.5):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(poll)
        raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{self.log_tail()}")

    def log_tail(self, lines=30):
        out = []
        for path in sorted((self.directory / "log").glob("slurm*.log")):
            if path.exists():
                out.append(f"--- {path.name}\n" + "\n".join(path.read_text().splitlines()[-lines:]))
        return "\n".join(out)


class MultiNodeCluster(SlurmCluster):
    """Nodes n1..nN, each a network namespace of this machine with its own address, host name
    and slurmd (``slurm-cluster.sh start --nodes N``); MPI between them goes over their bridge."""

    def __init__(self, directory, nodes=3):
        super().__init__(directory)
        self.nodes = nodes
        self.cut_off = set()  # nodes whose link a test took down

    @property
    def network(self):
        """NET_ID, NET_SUBNET, NET_NODES as the script recorded them."""
        text = (self.directory / "network.env").read_text()
        return dict(line.split("=", 1) for line in text.split())

    def node_names(self):
        return [f"n{k}" for k in range(1, self.nodes + 1)]

    def env(self, extra=None):
        """As for one node, with Open MPI's TCP (ranks and its out-of-band channel) on the bridge's
        subnet: loopback alone cannot reach another node."""
        subnet = self.network["NET_SUBNET"]
        return super().env({"OMPI_MCA_btl_tcp_if_include": subnet, "OMPI_MCA_oob_tcp_if_include": subnet,
                            **(extra or {})})

    def _netns(self, node):
        return f"hpn{self.network['NET_ID']}-{node.lstrip('n')}"

    def veth(self, node):
        """The bridge's end of ``node``'s link: down is a network partition of that node."""
        return f"hpv{self.network['NET_ID']}-{node.lstrip('n')}"

    def node_pids(self, node):
        """Every process running on ``node``: its slurmd, job steps and ranks."""
        proc = subprocess.run(["ip", "netns", "pids", self._netns(node)], capture_output=True, text=True,
                              timeout=30)
        return [int(p) for p in proc.stdout.split()]

    def kill_node(self, node):
        """The node dies: SIGKILL to its slurmd and everything it started, at once. Returns the pids."""
        pids = self.node_pids(node)
        _kill_at_once(pids)
        return pids

    def set_link(self, node, up):
        subprocess.run(["ip", "link", "set", self.veth(node), "up" if up else "down"], check=True, timeout=30)
        (self.cut_off.discard if up else self.cut_off.add)(node)

    def heal(self, timeout=180):
        """Every link up, every dead slurmd started again, every node idle: the cluster as a test
        that killed or cut off a node found it."""
        for node in self.node_names():
            # A cut-off node's job processes (batch script, supervisor, ranks) lived on without Slurm, and
            # its slurmd must end them once it answers again: under load that kept the node "completing"
            # past the start script's wait. They are the lost job's; end them before the link comes back.
            if node in self.cut_off:
                _kill_at_once([pid for pid in self.node_pids(node) if _command_name(pid) not in ("slurmd", None)])
            self.set_link(node, True)
        proc = self._script_start(timeout)
        if proc.returncode != 0:
            raise AssertionError(f"{SCRIPT.name} could not bring the nodes back:\n{proc.stderr[-3000:]}")


def _command_name(pid):
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None


def _kill(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


FREEZER = Path("/sys/fs/cgroup/freezer")  # cgroup v1's freezer, where this machine has it


def _kill_at_once(pids):
    """SIGKILL to ``pids`` as one event, as when a node dies. Killed one by one, a process may see another
    die and act, as nothing on a dead node can: an srun that finds its batch script gone cancels its step,
    and the standby's step (on another node) with it. (SIGSTOP first would not do: a process group left
    with stopped members gets SIGHUP and SIGCONT from the kernel.) So they are frozen (their cgroup), sent
    SIGKILL, and thawed: each dies before it runs again. Without a freezer, one by one."""
    group = FREEZER / f"hpctrain-kill-{os.getpid()}"
    try:
        group.mkdir(exist_ok=True)
        for pid in pids:
            try:
                (group / "cgroup.procs").write_text(str(pid))
            except ProcessLookupError:
                pass
        (group / "freezer.state").write_text("FROZEN")
        deadline = time.monotonic() + 10
        while (group / "freezer.state").read_text().strip() != "FROZEN" and time.monotonic() < deadline:
            time.sleep(0.01)
    except OSError:
        group = None
    for pid in pids:
        _kill(pid)
    if group is not None:
        (group / "freezer.state").write_text("THAWED")
        deadline = time.monotonic() + 10
        while (group / "cgroup.procs").read_text().split() and time.monotonic() < deadline:
            time.sleep(0.01)
        with contextlib.suppress(OSError):
            group.rmdir()


def start_or_reason(directory, nodes=1):
    """(cluster, None) or (None, why Slurm is unavailable here). ``nodes`` > 1: a
    :class:`MultiNodeCluster`."""
    if not shutil.which("bash"):
        return None, "bash not found"
    try:
        if nodes > 1:
            if not (shutil.which("ip") and shutil.which("nsenter") and shutil.which("unshare")):
                return None, "ip, nsenter and unshare are needed for a multi-node cluster"
            return MultiNodeCluster.start(directory, nodes=nodes), None
        return SlurmCluster.start(directory), None
    except SlurmUnavailable as exc:
        return None, str(exc)
