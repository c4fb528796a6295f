"""Configuration: TOML loading, key=value overrides typed by the field, validation errors."""
import pytest

from hpctrain.config import CheckpointConfig, TrainConfig, apply_override, load_config, step_budget, validate
from hpctrain.errors import ConfigError


def write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_toml_sections_and_defaults(tmp_path):
    path = write(tmp_path, '[run]\nname = "x"\n[train]\nbatch_size = 16\nlr = 1\n[comm]\nbackend = "mpi"\n'
                           '[checkpoint]\nevery_steps = 5\n')
    cfg = load_config(path, environ={})
    assert cfg.run.name == "x" and cfg.train.batch_size == 16
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)
    assert cfg.comm.backend == "mpi" and cfg.comm.compression == "none"
    assert isinstance(cfg.checkpoint, CheckpointConfig) and cfg.checkpoint.every_steps == 5
    assert cfg.monitor.log_every == 10 and cfg.monitor.progress == "auto"


def test_overrides_are_typed_by_the_field(tmp_path):
    cfg = load_config(None, ["train.batch_size=32", "checkpoint.every_steps=10", "train.lr=0.5",
                             "model.residual=true", "checkpoint.async_save=0", "run.name='quoted'",
                             "checkpoint.directory=/scratch/ck", "run.root=none"], environ={})
    assert cfg.train.batch_size == 32 and cfg.checkpoint.every_steps == 10 and cfg.train.lr == 0.5
    assert cfg.model.residual is True and cfg.checkpoint.async_save is False
    assert cfg.run.name == "quoted" and cfg.checkpoint.directory == "/scratch/ck" and cfg.run.root is None


def test_precedence_file_then_environment_then_command_line(tmp_path):
    path = write(tmp_path, '[comm]\nbackend = "horovod"\n')
    assert load_config(path, environ={"HPCTRAIN_BACKEND": "mpi"}).comm.backend == "mpi"
    assert load_config(path, ["comm.backend=horovod"], environ={"HPCTRAIN_BACKEND": "mpi"}).comm.backend == "horovod"


def test_unknown_key_names_it_lists_valid_keys_and_suggests(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "[train]\nbach_size = 3\n"), environ={})
    text = str(err.value)
    assert "unknown key train.bach_size" in text and "batch_size, " in text
    assert "HINT: did you mean train.batch_size?" in text
    with pytest.raises(ConfigError, match=r"unknown key comm.compresion.*\n.*did you mean comm.compression"):
        load_config(None, ["comm.compresion=fp16"], environ={})


def test_unknown_section_lists_valid_sections(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "[trian]\nlr = 1\n"), environ={})
    assert "unknown section [trian]" in str(err.value) and "run, model, data, train, comm" in str(err.value)
    assert "did you mean [train]" in str(err.value)


@pytest.mark.parametrize("override, message", [
    ("train.batch_size=big", "train.batch_size = 'big' is not an integer"),
    ("model.residual=maybe", "is not a boolean"),
    ("train.lr=fast", "is not a number"),
    ("batch_size=3", "not a section.key name"),
    ("train.batch_size", "not a key=value override"),
])
def test_bad_override_values(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override], environ={})


def test_wrong_type_in_toml(tmp_path):
    with pytest.raises(ConfigError, match=r"train.epochs = '3' is not an integer"):
        load_config(write(tmp_path, '[train]\nepochs = "3"\n'), environ={})
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(write(tmp_path, "[train\n"), environ={})
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml", environ={})


def valid(**sections):
    cfg = load_config(None, ["data.path=x.h5"] + [f"{k}={v}" for k, v in sections.items()], environ={})
    return cfg


@pytest.mark.parametrize("override, message", [
    ("comm.compression=fp8", "comm.compression = 'fp8' is not one of none, fp16"),
    ("comm.backend=nccl", "comm.backend = 'nccl' is not one of horovod, mpi"),
    ("train.optimizer=adamm", "did you mean train.optimizer = 'adam'"),
    ("train.precision=fp16", "needs a GPU"),
    ("train.batch_size=0", "train.batch_size = 0 must be > 0"),
    ("train.epochs=-1", "train.epochs = -1 must be >= 0"),
    ("comm.gradient_predivide_factor=0", "must be > 0"),
    ("train.lr_scaling=sqrt", "is not one of none, linear"),
    ("data.generate=mnist", "data.generate = 'mnist'"),
    ("run.name=a/b", "run.name"),
    ("train.on_nonfinite=ignore", r"train.on_nonfinite = 'ignore' is not one of auto, skip, rollback, stop"),
    ("train.on_nonfinite=rollbak", "did you mean train.on_nonfinite = 'rollback'"),
    ("train.max_nonfinite_skips=-1", r"train.max_nonfinite_skips = -1 must be >= 0"),
    ("train.max_rollbacks=-2", r"train.max_rollbacks = -2 must be >= 0"),
    ("train.rollback_lr_factor=0", r"train.rollback_lr_factor = 0.0 must be in \(0, 1\](.|\n)*HINT: e.g. "
                                   r"train.rollback_lr_factor=0.5"),
    ("train.rollback_lr_factor=1.5", r"train.rollback_lr_factor = 1.5 must be in \(0, 1\]"),
])
def test_validation_errors(override, message):
    cfg = load_config(None, ["data.path=x.h5", override], environ={})
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world_size=2)


def test_global_batch_must_divide_by_ranks_times_accumulation():
    cfg = load_config(None, ["data.path=x.h5", "train.global_batch_size=100", "train.accumulation=2"], environ={})
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=3)
    assert "train.global_batch_size = 100 is not divisible by ranks x accumulation = 3 x 2 = 6" in str(err.value)
    assert "HINT: use a multiple of 6 (e.g. 96 or 102)" in str(err.value)
    resolved = validate(cfg, world_size=5)
    assert resolved.train.batch_size == 10 and cfg.train.batch_size == 32  # the input is not changed


def test_fp16_is_fine_on_a_gpu_and_bf16_on_cpu():
    validate(load_config(None, ["data.path=x.h5", "train.precision=fp16"], environ={}), cuda=True)
    validate(load_config(None, ["data.path=x.h5", "train.precision=bf16"], environ={}))


def test_missing_data_path_unless_data_is_given():
    with pytest.raises(ConfigError, match="data.path is not set"):
        validate(TrainConfig())
    validate(TrainConfig(), need_data=False)


def test_to_toml_round_trip(tmp_path):
    cfg = load_config(None, ["train.lr=0.25", "run.name=a \"b\"", "checkpoint.keep_last=0"], environ={})
    again = load_config(write(tmp_path, cfg.to_toml()), environ={})
    assert again == cfg


def test_examples_are_valid():
    from pathlib import Path

    paths = sorted(Path(__file__).resolve().parent.parent.glob("examples/*.toml"))
    # pipeline_mlp.toml holds the settings of examples/hybrid_mlp.py, not an `hpctrain train` config.
    train_configs = [p for p in paths if p.name != "pipeline_mlp.toml"]
    assert {p.name for p in train_configs} >= {"digits.toml", "large_mlp.toml"}
    for path in train_configs:
        validate(load_config(path, environ={}), world_size=2)


def test_apply_override_on_a_built_config():
    cfg = apply_override(TrainConfig(), "monitor.log_every=3")
    assert cfg.monitor.log_every == 3


def _float_fields():
    import dataclasses

    cfg = TrainConfig()
    return [f"{s}.{f.name}" for s in ("run", "model", "data", "train", "comm", "checkpoint", "monitor")
            for f in dataclasses.fields(getattr(cfg, s)) if isinstance(getattr(getattr(cfg, s), f.name), float)]


@pytest.mark.parametrize("field", _float_fields())
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_every_float_option_refuses_non_finite_values(field, value):
    cfg = load_config(None, [f"{field}={value}"], environ={})
    with pytest.raises(ConfigError) as err:
        validate(cfg, world_size=1, need_data=False)
    text = str(err.value)
    assert f"{field} = " in text and "not a finite number" in text and f"HINT: give {field} a finite value" in text


def test_non_finite_from_toml_and_from_python_too(tmp_path):
    path = write(tmp_path, "[train]\nstep_timeout = inf\n")
    with pytest.raises(ConfigError, match=r"train.step_timeout = inf is not a finite number"):
        validate(load_config(path, environ={}), need_data=False)
    cfg = TrainConfig()
    cfg.train.lr = float("nan")
    with pytest.raises(ConfigError, match=r"train.lr = nan is not a finite number"):
        validate(cfg, need_data=False)


def test_nonfinite_policy_defaults_are_valid_and_one_keeps_the_learning_rate():
    cfg = validate(load_config(None, ["data.path=x.h5"], environ={}))
    assert (cfg.train.on_nonfinite, cfg.train.max_nonfinite_skips, cfg.train.max_rollbacks) == ("auto", 3, 2)
    validate(load_config(None, ["data.path=x.h5", "train.rollback_lr_factor=1", "train.on_nonfinite=stop"],
                         environ={}))


def test_unknown_shard_reduction_names_the_choices_and_the_closest():
    cfg = load_config(None, ["comm.shard=optimizer", "comm.shard_reduce=reducescatter"], environ={})
    with pytest.raises(ConfigError, match="comm.shard_reduce = 'reducescatter' is not one of auto, allreduce, "
                                          "reduce_scatter") as err:
        validate(cfg, world_size=2)
    assert "did you mean comm.shard_reduce = 'reduce_scatter'" in str(err.value.hint)


@pytest.mark.parametrize("epochs, max_steps, budget", [
    (0, 0, (1, 22, "one epoch: neither train.epochs nor train.max_steps is set")),
    (0, 50, (None, 50, "train.max_steps = 50")),  # max_steps alone is the budget, not one epoch of it
    (3, 0, (3, 66, "train.epochs = 3")),
    (3, 50, (3, 50, "train.max_steps = 50")),  # both: whichever ends first
    (2, 50, (2, 44, "train.epochs = 2")),
    (2, 44, (2, 44, "train.epochs = 2")),
])
def test_the_step_budget_is_the_first_of_epochs_and_max_steps(epochs, max_steps, budget):
    cfg = load_config(None, [f"train.epochs={epochs}", f"train.max_steps={max_steps}"], environ={})
    assert step_budget(cfg.train, 22) == budget


def test_a_configuration_that_is_not_text_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "job.toml"
    path.write_bytes(b"[train]\nlr = 0.1\n\xff\xfe")
    with pytest.raises(ConfigError, match=r"job.toml is not a text file: byte 0xff at offset 17 is not UTF-8"
                                          r"(.|\n)*HINT: give the TOML configuration"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match=r"cannot be read: Is a directory"):
        load_config(tmp_path, environ={})
