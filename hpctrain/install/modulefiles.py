"""The modulefiles of a site installation: ``MODULEFILES/hpctrain/<version>.lua`` for Lmod and
``MODULEFILES/hpctrain/<version>`` (Tcl) for Environment Modules. Lmod takes the ``.lua`` one
where both lie side by side; Environment Modules reads only files that start with ``#%Module``.

Loading either loads the MPI and HDF5 modules the installation was built with (where they
were modules; otherwise the help text names the MPI and HDF5 to keep on PATH), puts
``PREFIX/bin`` (the ``hpctrain`` command alone) on PATH and sets ``HPCTRAIN_HOME`` to the
prefix: the job scripts take the environment (``$HPCTRAIN_HOME/venv``), the examples and the
default configuration from there."""
from pathlib import Path

from .. import settings
from ..runtime.fsutil import write_text

SUMMARY = "data-parallel PyTorch training on HPC clusters (Horovod, MPI, parallel HDF5 checkpoints)"


def _help(record):
    modules = (f"Loads the modules it was built with: {' '.join(record.stack_modules)}" if record.stack_modules else
               f"Built against an MPI and HDF5 that were not modules: keep that mpirun ({record.mpirun}) first on PATH")
    return "\n".join([
        f"hpctrain {record.version}: {SUMMARY}",
        f"Installed in {record.prefix}",
        f"Built against {record.built_against()}; torch {record.torch}, Python {record.python}",
        modules,
        "Check:  hpctrain doctor",
        "Start:  hpctrain examples --copy mywork && cd mywork && sbatch slurm/train.sbatch",
        "        (or sbatch $" + settings.name("HOME") + "/share/hpctrain/slurm/train.sbatch from any directory)",
    ])


def _lua_string(text):
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def lua_modulefile(record):
    """The text of the Lmod modulefile for ``record``."""
    lines = [f"-- hpctrain {record.version}, written by `make install` ({record.installed_at})",
             f"help([==[\n{_help(record)}\n]==])",
             'whatis("Name: hpctrain")',
             f"whatis({_lua_string('Version: ' + record.version)})",
             f"whatis({_lua_string('Description: ' + SUMMARY)})"]
    lines += [f"depends_on({_lua_string(m)})" for m in record.stack_modules]
    lines += [f"local prefix = {_lua_string(record.prefix)}",
              f"setenv({_lua_string(settings.name('HOME'))}, prefix)",
              'prepend_path("PATH", pathJoin(prefix, "bin"))']
    return "\n".join(lines) + "\n"


def _tcl_word(text):
    if any(c in text for c in "{}\\\n"):
        raise ValueError(f"{text!r} cannot be written into a Tcl modulefile (braces, backslashes or new lines)\n"
                         "HINT: install into a PREFIX (and MODULEFILES) whose path has none of these")
    return "{" + text + "}"


def tcl_modulefile(record):
    """The text of the Environment Modules (Tcl) modulefile for ``record``."""
    help_lines = "\n".join(f"    puts stderr {_tcl_word(line)}" for line in _help(record).splitlines())
    lines = ["#%Module1.0",
             f"## hpctrain {record.version}, written by `make install` ({record.installed_at})",
             "proc ModulesHelp { } {", help_lines, "}",
             f"module-whatis {_tcl_word(f'hpctrain {record.version}: {SUMMARY}')}"]
    lines += [f"if {{ ![is-loaded {_tcl_word(m)}] }} {{ module load {_tcl_word(m)} }}" for m in record.stack_modules]
    lines += [f"set prefix {_tcl_word(record.prefix)}",
              f"setenv {settings.name('HOME')} $prefix",
              "prepend-path PATH $prefix/bin"]
    return "\n".join(lines) + "\n"


def modulefile_paths(record):
    """``(lua, tcl)``: where the two modulefiles of ``record`` go."""
    base = Path(record.modulefiles) / "hpctrain"
    return base / f"{record.module_version}.lua", base / record.module_version


def write_modulefiles(record):
    lua, tcl = modulefile_paths(record)
    lua.parent.mkdir(parents=True, exist_ok=True)
    write_text(lua, lua_modulefile(record))
    write_text(tcl, tcl_modulefile(record))
    return lua, tcl
