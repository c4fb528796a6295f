"""Reading a configuration: a TOML file, then ``HPCTRAIN_BACKEND`` (:mod:`hpctrain.settings`), then
``section.key=value`` overrides typed by the field they set; each later source wins.

>>> cfg = load_config("examples/digits.toml", ["train.batch_size=32", "comm.compression=fp16"])  # doctest: +SKIP
"""
from .. import settings
from ..errors import ConfigError
from .schema import TrainConfig, field_type, fields_of, section_names, section_of, set_field
from .values import parse_literal


def apply_override(cfg, text, source="command line"):
    """Apply one ``section.key=value`` override (the value typed by the field)."""
    if "=" not in text:
        raise ConfigError(f"{source}: {text!r} is not a key=value override",
                          hint="write overrides as section.key=value, e.g. train.batch_size=32")
    dotted, value = text.split("=", 1)
    dotted = dotted.strip()
    if dotted.count(".") == 2:  # section.kwargs.name=value: one keyword argument of a factory
        return _apply_argument_override(cfg, dotted, value, source)
    if dotted.count(".") != 1:
        raise ConfigError(f"{source}: {dotted!r} is not a section.key name",
                          hint=f"valid sections: {', '.join(section_names())}; e.g. train.lr=0.1")
    section, key = dotted.split(".")
    set_field(section_of(cfg, section, source), section, key, value, source, from_text=True)
    return cfg


def _apply_argument_override(cfg, dotted, value, source):
    section, key, name = dotted.split(".")
    target = section_of(cfg, section, source)
    if key not in fields_of(target) or field_type(target, key)[0] is not dict:
        tables = [f"{s}.{f}" for s in section_names() for f, _ in fields_of(getattr(cfg, s)).items()
                  if field_type(getattr(cfg, s), f)[0] is dict]
        raise ConfigError(f"{source}: {dotted!r}: {section}.{key} is not a table of keyword arguments",
                          hint=f"section.key=value for a setting; section.table.name=value only for "
                               f"{', '.join(tables)} (e.g. model.kwargs.width=1024)")
    if not name:
        raise ConfigError(f"{source}: {dotted!r} names no argument", hint=f"e.g. {section}.{key}.width=1024")
    getattr(target, key)[name] = parse_literal(value)
    return cfg


def _read_toml(path):
    try:
        import tomllib
    except ModuleNotFoundError:  # Python < 3.11
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise ConfigError("reading TOML needs Python >= 3.11 or the tomli package",
                              hint="pip install tomli") from None
    if str(path).endswith(".py"):
        raise ConfigError(f"{path} is a Python script, not a TOML configuration",
                          hint=f"run a training script as it is: mpirun -n 2 python {path} section.key=value ... "
                               f"(the job scripts in slurm/ take it in place of the TOML file)")
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"configuration file {path} does not exist",
                          hint="give the path of a TOML file, e.g. examples/digits.toml") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}", hint="fix the line named above") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a text file: byte {exc.object[exc.start]:#04x} at offset {exc.start} "
                          f"is not UTF-8", hint="give the TOML configuration (UTF-8 text), e.g. "
                                                "examples/digits.toml; a checkpoint or data file goes in "
                                                "checkpoint.resume or data.path") from None
    except OSError as exc:  # a directory, no permission
        raise ConfigError(f"configuration file {path} cannot be read: {exc.strerror or exc}",
                          hint="give the path of a TOML file you can read, e.g. examples/digits.toml") from None


def load_config(path=None, overrides=(), environ=None):
    """Read a TOML file (or start from defaults), then ``HPCTRAIN_BACKEND``, then ``key=value`` overrides.

    >>> cfg = load_config("examples/digits.toml", ["train.batch_size=32", "comm.backend=mpi"])  # doctest: +SKIP
    """
    cfg = TrainConfig() if path is None else TrainConfig.from_dict(_read_toml(path), source=str(path))
    backend = settings.get("BACKEND", environ=environ)
    if backend:
        cfg.comm.backend = backend.strip()
    for text in overrides:
        apply_override(cfg, text)
    return cfg

