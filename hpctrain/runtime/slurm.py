"""Slurm, known in one place: what the environment of a Slurm job, step or task says, and the Slurm commands
hpctrain asks (``squeue``, ``sinfo``, ``scontrol``), each with a timeout. A command that is missing, fails or
hangs answers "unsure" (``None``), never a guess. Who asks: :mod:`.world` (is this task a rank of an ``srun``
step), :mod:`hpctrain.job.runlock` (is the job or step that holds a lock still running),
:mod:`hpctrain.job.preemption` (requeue this job), :mod:`hpctrain.job.relaunch` (the allocation's nodes, and
which stopped answering), :mod:`hpctrain.job.standby` (the nodes a job holds, where a node's slurmd listens)."""
import contextlib
import ctypes
import os
import re
import shutil
import subprocess

TIMEOUT = 30  # seconds any Slurm command may take
# Node states (sinfo %t) of a node that will not run a job step
DOWN_STATES = ("down", "drain", "drng", "fail")
ACTIVE_JOB_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED")


# ---------------------------------------------------------------- the environment
def first_int(env, *names):
    """The first of the variables ``names`` that holds an integer (launchers' counts), or None."""
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            with contextlib.suppress(ValueError):
                return int(value.split("(")[0])  # SLURM_NTASKS may read "4(x2)"
    return None


def environment(environ=None):
    """What Slurm's variables say of this process's job (``None`` outside Slurm): the job id,
    its task count and node list (pure)."""
    env = os.environ if environ is None else environ
    return dict(slurm_job_id=env.get("SLURM_JOB_ID"),
                slurm_ntasks=first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"),
                slurm_nodelist=env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST"))


def task(environ=None):
    """``(rank, size, local rank)`` when this process is a task of an ``srun`` step, else None."""
    env = os.environ if environ is None else environ
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return first_int(env, "SLURM_PROCID"), first_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), first_int(env, "SLURM_LOCALID")
    return None


def task_key(environ=None):
    """``(job id, step id, task id)`` of a task of an ``srun`` step, as Slurm's variables write them, else None."""
    env = os.environ if environ is None else environ
    if task(env) is None or "SLURM_JOB_ID" not in env:
        return None
    return env["SLURM_JOB_ID"], env["SLURM_STEP_ID"], env["SLURM_PROCID"]


def slurmd_node(environ=None):
    """Slurm's name of this node (``SLURMD_NODENAME``), or None outside a job step."""
    return (os.environ if environ is None else environ).get("SLURMD_NODENAME")


def step_task_variables(job, step, environ=None):
    """``NAME=value`` entries found in the environment of every task of step ``job.step`` on this node (a
    test cluster's nodes may share one process table: the node's name tells theirs apart)."""
    node = slurmd_node(environ)
    return [f"SLURM_JOB_ID={job}", f"SLURM_STEP_ID={step}"] + ([f"SLURMD_NODENAME={node}"] if node else [])


def job_id(environ=None):
    """The id that ``scontrol requeue`` accepts for this job: ``<array job>_<task>`` inside a job array
    (requeueing the bare job id would requeue the whole array), else the job id, or ``None`` outside Slurm."""
    env = os.environ if environ is None else environ
    array_job, array_task = env.get("SLURM_ARRAY_JOB_ID"), env.get("SLURM_ARRAY_TASK_ID")
    return f"{array_job}_{array_task}" if array_job and array_task else env.get("SLURM_JOB_ID") or None


def step_of(environ=None):
    """``(<job>.<step>, restart count)`` (step ``batch`` in a job script), or ``(None, 0)`` outside Slurm."""
    env = os.environ if environ is None else environ
    number = env.get("SLURM_JOB_ID") or None
    step = f"{number}.{env.get('SLURM_STEP_ID') or 'batch'}" if number else None
    return step, int(env.get("SLURM_RESTART_COUNT") or 0)


def in_allocation(environ=None):
    """Inside a Slurm allocation, with ``srun`` to start steps in it."""
    env = os.environ if environ is None else environ
    return bool(env.get("SLURM_JOB_ID")) and shutil.which("srun") is not None


def allocated_tasks(environ=None):
    """``SLURM_NTASKS`` of the allocation (0 when not set)."""
    return first_int(os.environ if environ is None else environ, "SLURM_NTASKS") or 0


def tasks_per_node(spec, hosts):
    """``{host: tasks}`` from ``SLURM_TASKS_PER_NODE`` (``"2(x3),1"``: 2 tasks on each of the first three
    hosts, 1 on the next) over ``hosts`` in the allocation's order, or None when they do not match (pure).

    >>> tasks_per_node("2(x2),1", ["n1", "n2", "n3"])
    {'n1': 2, 'n2': 2, 'n3': 1}
    """
    counts = []
    for part in (spec or "").split(","):
        count, _, times = part.strip().partition("(x")
        try:
            counts += [int(count)] * (int(times.rstrip(")")) if times else 1)
        except ValueError:
            return None
    return dict(zip(hosts, counts)) if hosts and len(counts) == len(hosts) else None


def job_script_environment(environ, tasks):
    """``environ`` of a one-task step, as the job script of a job of ``tasks`` tasks sees it: without the
    step's own variables (a supervisor started from the step starts the ranks for the whole job)."""
    env = {k: v for k, v in environ.items() if not k.startswith("SLURM_STEP")}
    env["SLURM_NTASKS"] = env["SLURM_NPROCS"] = str(tasks)
    return env


# ---------------------------------------------------------------- the commands
def _run(args):
    """The finished Slurm command, or None when it is missing, failed to start or hung."""
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=TIMEOUT)
    except (OSError, subprocess.SubprocessError):
        return None


def hostnames(nodelist):
    """The host names of a Slurm node list (``n[1-3]``), or None when unsure."""
    if not nodelist or shutil.which("scontrol") is None:
        return None
    proc = _run(["scontrol", "show", "hostnames", nodelist])
    return (proc.stdout.split() or None) if proc is not None else None


def job_hosts(environ=None):
    """The host names of this job's allocation, or None when unsure."""
    env = os.environ if environ is None else environ
    return hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"))


def squeue(args):
    """stdout of ``squeue -h ARGS``; ``None`` if unsure (no squeue, failed, hung); ``""``: unknown job."""
    found = shutil.which("squeue")
    proc = _run([found, "-h", *args]) if found else None
    if proc is None:
        return None
    if proc.returncode != 0:
        return "" if "Invalid job id" in proc.stderr else None
    return proc.stdout


def job_active(job):
    """False when squeue positively says the job is not pending/running; True if unsure."""
    if not job:
        return True
    out = squeue(["-j", str(job), "-o", "%T"])
    return True if out is None else any(s in ACTIVE_JOB_STATES for s in out.split())


def step_active(step):
    """False when squeue positively says step ``<job>.<step>`` is not running; True if unsure."""
    if not step or "." not in step:
        return True
    out = squeue(["-s", "-j", step.split(".")[0], "-o", "%i"])
    return True if out is None else step in out.split()


def node_states(sinfo_text):
    """``{node: state}`` from ``sinfo -h -N -o "%N %t"`` (pure); ``*`` after a state: not answering Slurm."""
    lines = (line.strip().partition(" ") for line in sinfo_text.splitlines())
    return {name: state.strip() for name, _, state in lines if name}


def unresponsive_nodes(sinfo_text, nodes):
    """The nodes of ``nodes`` that ``sinfo -h -N -o "%N %t"`` shows down, failing, drained or not
    responding, in ``nodes``' order (pure)."""
    states = node_states(sinfo_text)
    return [n for n in nodes if n in states and (states[n].endswith("*") or states[n].startswith(DOWN_STATES))]


def sinfo(nodes):
    """``sinfo -h -N -o "%N %t"`` of ``nodes`` ("" when unsure)."""
    proc = _run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %t"])
    return proc.stdout if proc is not None else ""


def node_state(node):
    return node_states(sinfo([node])).get(node, "")


def job_nodes(job):
    """The host names job ``job`` holds now (a --no-kill job loses the nodes that fail), or None if unsure."""
    found = shutil.which("squeue")
    proc = _run([found, "-h", "-j", job, "-o", "%N"]) if found and job else None
    nodelist = proc.stdout.strip() if proc is not None else ""
    return hostnames(nodelist) if nodelist else None


def slurmd_address(node):
    """``(address, port)`` where ``node``'s slurmd listens (NodeAddr, SlurmdPort), or None if unsure."""
    shown = _run(["scontrol", "-o", "show", "node", node]) if shutil.which("scontrol") and node else None
    config = _run(["scontrol", "show", "config"]) if shown is not None else None
    addr = re.search(r"\bNodeAddr=(\S+)", shown.stdout) if shown is not None else None
    port = re.search(r"^SlurmdPort\s*=\s*(\d+)", config.stdout, re.M) if config is not None else None
    return (addr.group(1), int(port.group(1))) if addr and port else None


def left_allocation(node, job):
    """True once Slurm has removed ``node`` from job ``job`` (a --no-kill job losing a node)."""
    nodes = job_nodes(job) if job else None
    return nodes is not None and node not in nodes


def requeue(job, scontrol, timeout=60):
    """``scontrol requeue JOB``: the finished process (raises OSError, TimeoutExpired)."""
    return subprocess.run([scontrol, "requeue", job], capture_output=True, text=True, timeout=timeout)


def complete_job(job, status):
    """End job ``job`` as the exit of its batch script with ``status`` would: COMPLETED for 0, else FAILED, so that
    ``sacct`` and ``afterok`` dependencies see the truth (``scancel`` would say CANCELLED). Through libslurm's
    ``slurm_complete_job`` (the job's owner may call it), in the library the Slurm commands here use. False
    where that library is not found or refuses."""
    lib = _libslurm()
    if lib is None or not str(job).isdigit():
        return False
    wait_status = -status & 0x7F if status < 0 else min(status, 255) << 8  # as wait(2) says it: signal or code
    return lib.slurm_complete_job(ctypes.c_uint32(int(job)), ctypes.c_uint32(wait_status)) == 0


def _libslurm():
    """libslurm as ``scontrol`` links it (``ldd``: Debian's is a private libslurmfull.so), loaded and initialised;
    None if not found."""
    scontrol = shutil.which("scontrol")
    proc = _run(["ldd", scontrol]) if scontrol else None
    found = re.search(r"=>\s*(/\S*libslurm(?:full)?\.so\S*)", proc.stdout) if proc is not None else None
    if found is None:
        return None
    try:
        lib = ctypes.CDLL(found.group(1), mode=ctypes.RTLD_GLOBAL)  # its plugins resolve their symbols in it
        if hasattr(lib, "slurm_init"):  # Slurm 22.05 on: reads slurm.conf and loads the plugins first
            lib.slurm_init(None)
        return lib
    except OSError:
        return None
