"""The package's structure, checked on every run of the suite (docs/architecture.md).

* layers: a top-level package imports only packages of lower layers, at module level or
  inside a function; no two modules of one package import each other in a circle; inside
  ``checkpoint/`` the same holds for its subpackages and top modules (``CHECKPOINT_LAYERS``);
* size: no class over 160 lines, no function over 80, but those named in ``LONG`` with why;
* names: no two public classes, functions or constants of the package share a name, but the
  entry-point convention of the command modules (``main``, ``build_parser``);
* at most 8 modules directly in ``hpctrain/``;
* ``HPCTRAIN_*`` variables are read in ``settings.py`` alone, Slurm's in ``runtime/slurm.py``, other
  programs' (MPI, Horovod, modules) in ``settings.py`` or where its docstring says; ``horovod`` is
  imported in ``backends/horovod_backend.py`` alone, and no module keeps a test hook;
* ``hpctrain.parallel`` uses the checkpoint package through ``checkpoint/planners/__init__.py`` alone.
"""
import ast
import collections
import pathlib
import re

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "hpctrain"

# Lowest first. A name may import the names of lower layers only (and itself).
LAYERS = (
    ("__init__", "errors", "settings", "state"),  # the base: imports nothing of hpctrain
    ("runtime",),  # this process in the job: MPI world, node, files, Slurm, coordination
    ("config", "install"),  # the schema, loading, validation; a site installation's record and modulefiles
    ("data", "models", "backends"),
    ("checkpoint",),  # its own layers: CHECKPOINT_LAYERS
    ("parallel",),
    ("job",),  # a run on the cluster: run directory, lock, signals, watchdog, relaunches
    ("monitoring",),  # reads and writes the run directory's metrics
    ("training",),  # composes a run of everything above
    ("commands",),
    ("cli",),  # the command table: names the commands, imports them when run
    ("__main__",),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}

# Inside checkpoint/, lowest first: its subpackages and top-level modules, each importing only lower rows (and
# itself), so that a change to when to save never opens the bytes on disk, and tuning I/O never the run level.
CHECKPOINT_LAYERS = (
    ("content",),  # what a checkpoint holds: format, metadata, snapshot, plan; no file opened
    ("io",),  # bytes on disk: the HDF5 file, writer, reader, direct and mapped writes, I/O settings, agreement
    ("policy", "interval", "directory"),  # when to save, how often, what to keep; the checkpoint directory
    ("commit",),  # the one save pipeline of a run's directory
    ("planners", "background"),  # who writes which part, per kind of state (save_checkpoint...); async_save
    ("local",),  # the node-local level: its recovery writes an ordinary file through commit
    ("manager",),  # a run's checkpoints: composes all of the above
    ("__init__",),
)
CHECKPOINT_LAYER = {name: i for i, names in enumerate(CHECKPOINT_LAYERS) for name in names}

MAX_CLASS, MAX_FUNCTION, MAX_TOP_MODULES = 160, 80, 8
# "path:name" -> why it is longer than the limit
LONG = {
}
# public names that several modules define on purpose
SHARED_NAMES = {
    "main": "the entry point of each command module (python -m, the cli table)",
    "build_parser": "each command module's argparse parser",
}


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def _name(path):
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path):
    """``[(imported module, line)]`` of every import of hpctrain in ``path``, anywhere in it."""
    tree = ast.parse(path.read_text())
    here = _name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.split(".")[0] == "hpctrain"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "hpctrain":
                continue
            for alias in node.names:  # ``from . import x`` may name a module
                candidate = f"{base}.{alias.name}"
                found.append((candidate if _exists(candidate) else base, node.lineno))
    return found


def _exists(module):
    path = PACKAGE.parent.joinpath(*module.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _top(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_top_level_name_has_a_layer():
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").is_file()}
    assert names <= set(LAYER), f"give these a layer in LAYERS: {sorted(names - set(LAYER))}"


def test_imports_run_downward_only():
    wrong = []
    for path in _modules():
        me = _top(_name(path))
        for target, line in _imports(path):
            other = _top(target)
            if other != me and LAYER[other] >= LAYER[me]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {me} (layer {LAYER[me]}) imports "
                             f"{target} (layer {LAYER[other]})")
    assert not wrong, "imports that run sideways or upward:\n" + "\n".join(wrong)


def _checkpoint_part(module):
    """The row of ``CHECKPOINT_LAYERS`` a module of ``hpctrain.checkpoint`` belongs to."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 else "__init__"


def test_every_checkpoint_part_has_a_layer():
    root = PACKAGE / "checkpoint"
    names = {p.stem if p.is_file() else p.name for p in root.iterdir()
             if (p.suffix == ".py") or (p / "__init__.py").is_file()}
    missing = sorted(names - set(CHECKPOINT_LAYER))
    assert not missing, f"give these a row in CHECKPOINT_LAYERS: {missing}"


def test_checkpoint_imports_run_downward_only():
    wrong = []
    for path in sorted((PACKAGE / "checkpoint").rglob("*.py")):
        me = _checkpoint_part(_name(path))
        for target, line in _imports(path):
            if _top(target) != "checkpoint":
                continue
            other = _checkpoint_part(target)
            if other != me and CHECKPOINT_LAYER[other] >= CHECKPOINT_LAYER[me]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: checkpoint.{me} (row "
                             f"{CHECKPOINT_LAYER[me]}) imports {target} (row {CHECKPOINT_LAYER[other]})")
    assert not wrong, "imports inside checkpoint/ that run sideways or upward:\n" + "\n".join(wrong)


# The one module of the checkpoint package that hpctrain.parallel (its split models' planner) may import.
CHECKPOINT_SURFACE = "hpctrain.checkpoint.planners"


def test_parallel_uses_the_checkpoint_package_through_its_surface():
    wrong = [f"{path.relative_to(PACKAGE.parent)}:{line}: imports {target}"
             for path in sorted((PACKAGE / "parallel").rglob("*.py")) for target, line in _imports(path)
             if _top(target) == "checkpoint" and target != CHECKPOINT_SURFACE]
    assert not wrong, f"import these through {CHECKPOINT_SURFACE} (add what is missing there):\n" + "\n".join(wrong)


def test_no_circle_of_imports_inside_a_package():
    graph = collections.defaultdict(set)
    for path in _modules():
        me = _name(path)
        for target, _ in _imports(path):
            if _top(target) == _top(me) and target != me and not me.startswith(target + "."):
                graph[me].add(target)
    circles = []

    def visit(node, trail):
        for nxt in sorted(graph[node]):
            if nxt in trail:
                circles.append(" -> ".join(trail[trail.index(nxt):] + [nxt]))
            elif len(trail) < 12:
                visit(nxt, trail + [nxt])

    for start in sorted(graph):
        visit(start, [start])
    assert not circles, "modules that import each other in a circle:\n" + "\n".join(sorted(set(circles)))


def _definitions():
    for path in _modules():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def test_no_class_or_function_too_long():
    long = []
    for path, node in _definitions():
        limit = MAX_CLASS if isinstance(node, ast.ClassDef) else MAX_FUNCTION
        lines = node.end_lineno - node.lineno + 1
        key = f"{path.relative_to(PACKAGE)}:{node.name}"
        if lines > limit and key not in LONG:
            long.append(f"{key}: {lines} lines (at most {limit})")
    assert not long, "split these, or name them in LONG with the reason:\n" + "\n".join(long)
    stale = [k for k in LONG if not any(f"{p.relative_to(PACKAGE)}:{n.name}" == k for p, n in _definitions())]
    assert not stale, f"LONG names what no longer exists: {stale}"


def test_no_two_public_names_alike():
    where = collections.defaultdict(list)
    for path in _modules():
        for node in ast.parse(path.read_text()).body:
            names = []
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name) and t.id.isupper()]
            for name in names:
                if not name.startswith("_") and name not in SHARED_NAMES:
                    where[name].append(str(path.relative_to(PACKAGE)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, "one name for one thing; defined more than once: " + "; ".join(
        f"{n} in {', '.join(p)}" for n, p in sorted(twice.items()))


def test_few_modules_directly_in_the_package():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{len(top)} modules directly in hpctrain/: {top}"


OTHER_PROGRAMS = r"(OMPI|PMIX?|MPI|OMP|HOROVOD)_[A-Za-z0-9_]+|LOADEDMODULES"
# modules that read (or set) other programs' variables themselves, as settings.py's docstring lists them
INTERPRETED = {"settings.py": ".*", "backends/horovod_backend.py": "HOROVOD_CYCLE_TIME",
               "runtime/world.py": r"(OMPI_COMM_WORLD|PMIX?)_[A-Z_]+|MPI_LOCALRANKID|OMP_NUM_THREADS|"
                                   r"OMPI_MCA_mpi_yield_when_idle"}


@pytest.mark.parametrize("variables, homes", [(r"HPCTRAIN_[A-Z0-9_]+", {"settings.py": ".*"}),
                                               (r"SLURMD?_[A-Z0-9_]+", {"runtime/slurm.py": ".*"}),
                                               (OTHER_PROGRAMS, INTERPRETED)])
def test_environment_variables_are_read_in_one_module(variables, homes):
    """A variable is read by its name: no string that is the whole name of one (``"OMPI_MCA_"`` of
    ``f"OMPI_MCA_{param}"`` is one too) outside ``homes``, but those each home's pattern allows (messages
    that name one, ``HPCTRAIN_CKPT_SERIAL=1``, are text; settings.name(key) names one)."""
    found = [f"{rel}:{node.lineno}: {node.value}" for p in _modules() for rel in [str(p.relative_to(PACKAGE))]
             for node in ast.walk(ast.parse(p.read_text()))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(variables, node.value)
             and not re.fullmatch(homes.get(rel, "(?!)"), node.value)]
    assert not found, f"read these variables in {sorted(homes)} (see settings.py's docstring): {found}"


def test_horovod_is_imported_by_its_backend_alone():
    found = [str(p.relative_to(PACKAGE)) for p in _modules() if str(p.relative_to(PACKAGE)) !=
             "backends/horovod_backend.py" and any(target.split(".")[0] == "horovod" for target in _all_imports(p))]
    assert not found, f"only backends/horovod_backend.py imports horovod; also: {found}"


def _all_imports(path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.module or ""


def test_no_test_hooks_in_the_package():
    hooks = [f"{p.relative_to(PACKAGE)}:{i}" for p in _modules()
             for i, line in enumerate(p.read_text().splitlines(), 1) if "Test hook" in line or "test hook" in line]
    assert not hooks, f"test hooks belong in the tests (monkeypatch a seam): {hooks}"
