"""A standby supervisor on another node, so that the loss of a job's first node does not stop the job.

In a job script the batch shell, ``hpctrain launch`` (the supervisor) and usually rank 0 all live on the
allocation's first node. When that node dies or is cut off, Slurm kills the batch step, and a ``--no-kill``
job would stay allocated with nothing running until its time limit. ``slurm/resilient.sbatch`` therefore
starts this standby as a one-task step on another node::

    srun --overlap -N1 -n1 --exclude=$(hostname) python -m hpctrain.job.standby --batch-host $(hostname) \\
        --tasks $SLURM_NTASKS --tasks-per-node $SLURM_TASKS_PER_NODE --run-dir RUN_DIR \\
        --log RUN_DIR/standby-JOB.out -- [hpctrain launch arguments ...]

It asks Slurm every ``--poll`` seconds which nodes the job holds. Once Slurm has taken the batch host out of
the job (after its ``SlurmdTimeout``; the batch step is gone then, so two supervisors never run at once), it
runs ``hpctrain launch --exclude BATCH_HOST`` with the same arguments on the nodes left: the ranks resume from
the newest checkpoint. When that supervisor ends, the standby ends the job (``scancel``), so that no
allocation is held idle; a ``takeover`` and a ``job_end`` record in ``metrics.jsonl`` say what happened and
how long training stood still. A job that ends normally ends this step with it."""
import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

from ..runtime import slurm
from ..runtime.coordination import read_records
from . import rundir

_NAME = "hpctrain standby"
POLL_SECONDS = 5.0


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
    parser.add_argument("--poll", type=float, default=POLL_SECONDS, help="seconds between two looks (default 5)")
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


def wait_for_loss(batch_host, job, poll):
    """Block until Slurm takes ``batch_host`` out of ``job`` (True), or the job is over (False)."""
    while True:
        nodes = slurm.job_nodes(job)
        if nodes is not None and batch_host not in nodes:
            return True
        if nodes is None and not slurm.job_active(job):
            return False
        time.sleep(poll)


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
    _say(f"watching job {job}: takes over if Slurm takes the batch host {args.batch_host} out of the job")
    if not wait_for_loss(args.batch_host, job, args.poll):
        return 0
    noticed = time.time()
    ranks = remaining_ranks(args.tasks, args.tasks_per_node, slurm.job_hosts(env) or [], args.batch_host)
    step, at = (_steps(args.run_dir) or [(None, None)])[-1]
    idle = None if at is None else round(noticed - at, 1)
    _say(f"Slurm took the batch host {args.batch_host} out of job {job} (last step {step}, "
         f"{'?' if idle is None else idle} s ago); taking over with {ranks} rank(s) on the nodes left")
    rundir.append_metrics(args.run_dir, {"kind": "takeover", "host": socket.gethostname(), "lost": args.batch_host,
                                         "last_step": step, "seconds_since_last_step": idle, "ranks": ranks}, _say)
    cmd = [sys.executable, "-m", "hpctrain", "launch", "--exclude", args.batch_host, "-n", str(ranks), *launch]
    child = subprocess.Popen(cmd, env=slurm.job_script_environment(env, args.tasks))
    status = child.wait()
    after = [t for _, t in _steps(args.run_dir) if t > noticed]
    still = None if at is None or not after else round(after[0] - at, 1)
    _say(f"the supervisor ended with status {status}; training stood still {'?' if still is None else still} s; "
         f"ending job {job} (scancel) so that no allocation is held idle"
         + ("" if status == 0 else f"; resubmit with RUN_DIR={args.run_dir} to continue from the newest checkpoint"))
    rundir.append_metrics(args.run_dir, {"kind": "job_end", "by": "standby", "host": socket.gethostname(),
                                         "status": status, "stood_still_s": still,
                                         "seconds_since_takeover": round(time.time() - noticed, 1)}, _say)
    scancel = shutil.which("scancel")
    if scancel and job:
        subprocess.call([scancel, job], timeout=slurm.TIMEOUT)
    return status


if __name__ == "__main__":
    sys.exit(main())
