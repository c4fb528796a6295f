"""A standby supervisor on another node, so that the loss of a job's first node does not stop the job.

In a job script the batch shell, ``hpctrain launch`` (the supervisor) and usually rank 0 all live on the
allocation's first node. When that node dies or is cut off, Slurm kills the batch step, and a ``--no-kill``
job would stay allocated with nothing running until its time limit. ``slurm/resilient.sbatch`` therefore
starts this standby as a one-task step on another node::

    srun --overlap -N1 -n1 --exclude=$(hostname) python -m hpctrain.job.standby --batch-host $(hostname) \\
        --tasks $SLURM_NTASKS --tasks-per-node $SLURM_TASKS_PER_NODE --run-dir RUN_DIR \\
        --log RUN_DIR/standby-JOB.out -- [hpctrain launch arguments ...]

It knocks at the batch host's slurmd every ``--heartbeat`` seconds (a TCP connection to NodeAddr:SlurmdPort,
which compute nodes reach for Slurm's own message fan-out) and asks Slurm every ``--poll`` seconds which nodes
the job holds. The batch host is lost when its slurmd has taken no connection for ``--grace`` seconds (dead:
refused or unreachable; cut off: no answer) while Slurm still answered this node (a standby that is itself cut
off never takes over), or once Slurm takes it out of the job (after its ``SlurmdTimeout``, 300 s by default):
whichever comes first. Then it runs ``hpctrain launch --exclude BATCH_HOST`` with the same arguments on the
nodes left, telling the ranks (``HPCTRAIN_LOST_NODES``) that the lost node's run lock is stale: the ranks resume
from the newest checkpoint. When that supervisor ends, the standby ends the job as its job script would have
(COMPLETED or FAILED, by the supervisor's exit status), so that no allocation is held idle and ``afterok``
dependencies fire; a ``takeover`` and a ``job_end`` record in ``metrics.jsonl`` say what happened and how long
training stood still. A job that ends normally ends this step with it. The knock is armed once it has been
answered: a slurmd this node cannot reach from the start (a firewall) leaves the standby to Slurm's view alone,
and it says so."""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from .. import settings
from ..runtime import slurm
from ..runtime.coordination import read_records
from . import rundir

_NAME = "hpctrain standby"
POLL_SECONDS = 5.0  # between two squeue calls: slurmctld answers every job's standby
HEARTBEAT_SECONDS = 2.0  # between two knocks at the batch host's slurmd (and each knock's timeout)
GRACE_SECONDS = 10.0  # of silence before the batch host counts as lost: a slurmd restart takes less


def _say(text):
    print(f"{_NAME} on {socket.gethostname()}: {text}", flush=True)


def build_parser():
    parser = argparse.ArgumentParser(prog="python -m hpctrain.job.standby", description=__doc__.split("\n\n")[0],
                                     epilog="slurm/resilient.sbatch starts it, as a one-task step on another node")
    parser.add_argument("--batch-host", required=True, help="the node the job script runs on")
    parser.add_argument("--tasks", type=int, required=True, help="the job's tasks (SLURM_NTASKS of the job script)")
    parser.add_argument("--tasks-per-node", required=True, help="SLURM_TASKS_PER_NODE of the job script")
    parser.add_argument("--run-dir", required=True, help="the run directory (records go to its metrics.jsonl)")
    parser.add_argument("--log", default=None, help="append this process's and the supervisor's output to this "
                                                     "file itself (not through Slurm's I/O, which goes with srun)")
    parser.add_argument("--poll", type=float, default=POLL_SECONDS,
                        help="seconds between two questions to Slurm (default 5)")
    parser.add_argument("--heartbeat", type=float, default=HEARTBEAT_SECONDS,
                        help="seconds between two knocks at the batch host's slurmd (default 2)")
    parser.add_argument("--grace", type=float, default=GRACE_SECONDS,
                        help="seconds the batch host may not answer before the standby takes over (default 10)")
    parser.add_argument("launch", nargs=argparse.REMAINDER, help="-- then the arguments of hpctrain launch")
    return parser


def remaining_ranks(tasks, spec, hosts, lost):
    """The tasks of the allocation less those of ``lost`` (pure): by ``SLURM_TASKS_PER_NODE`` when it maps
    onto ``hosts``, else an equal share per node."""
    per_node = slurm.tasks_per_node(spec, hosts)
    if per_node is not None:
        return sum(k for h, k in per_node.items() if h != lost)
    return tasks - tasks // max(1, len(hosts))


def _steps(run_dir):
    """``[(step, timestamp)]`` of the run's ``train`` records, oldest first."""
    try:
        records = read_records(os.path.join(run_dir, rundir.METRICS_FILE))
    except OSError:
        records = []
    return [(r.get("step"), r["timestamp"]) for r in records if r.get("kind") == "train" and r.get("timestamp")]


def answers(address, timeout):
    """Does ``address`` (host, port) take a TCP connection within ``timeout`` seconds?"""
    try:
        with socket.create_connection(address, timeout=timeout):
            return True
    except OSError:  # refused (nothing listens: the node's processes died), unreachable, timed out
        return False


def wait_for_loss(batch_host, job, poll, address=None, grace=GRACE_SECONDS, heartbeat=HEARTBEAT_SECONDS,
                  clock=time.monotonic):
    """Block until ``batch_host`` is lost, and say how (a line), or until the job is over (None). Lost: its slurmd
    at ``address`` was heard once and has then been silent for ``grace`` seconds while Slurm still answered this
    node (so that it is not this node that is cut off), or Slurm took it out of ``job``."""
    heard, warned, silent_since, asked, slurm_answered = False, False, None, None, None
    started = clock()
    while True:
        now = clock()
        if asked is None or now - asked >= poll:
            asked = now
            nodes = slurm.job_nodes(job)
            if nodes is not None and batch_host not in nodes:
                return f"Slurm took {batch_host} out of job {job}"
            if nodes is None and not slurm.job_active(job):
                return None
            slurm_answered = now if nodes is not None else slurm_answered
        if address is not None and answers(address, heartbeat):
            if not heard:
                _say(f"{batch_host}'s slurmd at {address[0]}:{address[1]} answers: taking over if it stops "
                     f"answering for {grace:g} s")
            heard, silent_since = True, None
        elif address is not None and heard:
            silent_since = now if silent_since is None else silent_since
            if clock() - silent_since >= grace and slurm_answered is not None and slurm_answered >= silent_since:
                return f"{batch_host} stopped answering ({clock() - silent_since:.0f} s without its slurmd)"
        elif address is not None and not warned and now - started >= grace:
            _say(f"cannot reach {batch_host}'s slurmd at {address[0]}:{address[1]}: waiting on Slurm alone "
                 f"(it takes a node out after SlurmdTimeout)")
            warned = True
        time.sleep(max(0.0, heartbeat - (clock() - now)))


def main(argv=None, environ=None):
    args = build_parser().parse_args(argv)
    env = dict(os.environ if environ is None else environ)
    launch = args.launch[1:] if args.launch[:1] == ["--"] else args.launch
    job = slurm.job_id(env)
    child = None
    if args.log:  # srun's I/O forwarding ends with the srun process, which lives on the batch host
        fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for out in (sys.stdout, sys.stderr):
            out.flush()
            os.dup2(fd, out.fileno())
        os.close(fd)

    def on_signal(signum, frame):  # before a takeover: the job ended, and so does its standby
        if child is None:
            sys.exit(0)
        child.send_signal(signum)  # after: the supervisor passes it to the ranks, as the job script's would

    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
        signal.signal(sig, on_signal)
    _say(f"watching job {job}: takes over if the batch host {args.batch_host} stops answering, or Slurm takes it "
         "out of the job")
    how = wait_for_loss(args.batch_host, job, args.poll, slurm.slurmd_address(args.batch_host), args.grace,
                        args.heartbeat)
    if how is None:
        return 0
    noticed = time.time()
    ranks = remaining_ranks(args.tasks, args.tasks_per_node, slurm.job_hosts(env) or [], args.batch_host)
    step, at = (_steps(args.run_dir) or [(None, None)])[-1]
    idle = None if at is None else round(noticed - at, 1)
    _say(f"the batch host is lost: {how} (last step {step}, {'?' if idle is None else idle} s ago); "
         f"taking over with {ranks} rank(s) on the nodes left")
    rundir.append_metrics(args.run_dir, {"kind": "takeover", "host": socket.gethostname(), "lost": args.batch_host,
                                         "noticed": how, "last_step": step, "seconds_since_last_step": idle,
                                         "ranks": ranks}, _say)
    cmd = [sys.executable, "-m", "hpctrain", "launch", "--exclude", args.batch_host, "-n", str(ranks), *launch]
    # Slurm may still count the batch host's step as running: its run lock is stale for the new ranks
    child = subprocess.Popen(cmd, env={**slurm.job_script_environment(env, args.tasks),
                                       settings.name("LOST_NODES"): args.batch_host})
    status = child.wait()
    after = [t for _, t in _steps(args.run_dir) if t > noticed]
    still = None if at is None or not after else round(after[0] - at, 1)
    _say(f"the supervisor ended with status {status}; training stood still {'?' if still is None else still} s; "
         f"ending job {job} as {'COMPLETED' if status == 0 else 'FAILED'}, as its job script would have"
         + ("" if status == 0 else f"; resubmit with RUN_DIR={args.run_dir} to continue from the newest checkpoint"))
    rundir.append_metrics(args.run_dir, {"kind": "job_end", "by": "standby", "host": socket.gethostname(),
                                         "status": status, "stood_still_s": still,
                                         "seconds_since_takeover": round(time.time() - noticed, 1)}, _say)
    if job and not slurm.complete_job(job, status):  # Slurm kills this step with the job
        _say(f"libslurm could not end job {job} with status {status}: scancel (the job shows CANCELLED)")
        scancel = shutil.which("scancel")
        if scancel:
            subprocess.call([scancel, job], timeout=slurm.TIMEOUT)
    return status


if __name__ == "__main__":
    sys.exit(main())
