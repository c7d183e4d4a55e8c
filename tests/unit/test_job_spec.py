"""JobSpec: defaults, validation naming the field, files, flags and the JSON round trip."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from ps_common.job import JobError, JobSpec, add_job_arguments, job_from_args
from ps_server.coordinator.checkpointer import Interval


def test_defaults():
    job = JobSpec()
    assert dataclasses.asdict(job) == {
        "model": "mlp", "hidden": (64,), "data": "digits", "epochs": 10, "batch_size": 32,
        "optimizer": "adam", "lr": 0.002, "mode": "async", "seed": 0, "tasks_per_epoch": 8,
        "evaluate_every": 1, "checkpoint_dir": "", "shared_memory": True}


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        JobSpec().epochs = 3  # type: ignore[misc]


def test_unknown_field_is_refused_naming_it():
    with pytest.raises(JobError) as caught:
        JobSpec.from_mapping({"epochs": 2, "learning_rate": 0.1})
    assert "learning_rate" in str(caught.value)


def test_dashes_in_keys_mean_underscores():
    job = JobSpec.from_mapping({"batch-size": 16, "tasks-per-epoch": 4})
    assert (job.batch_size, job.tasks_per_epoch) == (16, 4)


@pytest.mark.parametrize("field, value", [
    ("epochs", 0),
    ("batch_size", -1),
    ("optimizer", "rmsprop"),
    ("mode", "ssp"),
    ("mode", "ssp:-1"),
    ("mode", "bsp"),
    ("mode", 2),
    ("lr", 0),
    ("hidden", "a,b"),
    ("tasks_per_epoch", 0),
    ("evaluate_every", -1),
    ("evaluate_every", 1.5),
    ("evaluate_every", True),
    ("seed", -1),
    ("model", ""),
    ("data", ""),
    ("hidden", [64, 0]),
    ("epochs", 1.5),
])
def test_invalid_field_is_refused_naming_it(field, value):
    with pytest.raises(JobError) as caught:
        JobSpec.from_mapping({field: value})
    assert caught.value.field == field
    assert field in str(caught.value)


@pytest.mark.parametrize("field, value", [
    ("epochs", 0), ("batch_size", 0), ("optimizer", "rmsprop"), ("lr", -1.0)])
def test_constructor_validates_too(field, value):
    with pytest.raises(JobError) as caught:
        JobSpec(**{field: value})
    assert caught.value.field == field


@pytest.mark.parametrize("value, expected", [
    ("128,64", (128, 64)), (32, (32,)), ([16, 8], (16, 8)), ("256", (256,))])
def test_hidden_forms(value, expected):
    assert JobSpec.from_mapping({"hidden": value}).hidden == expected


@pytest.mark.parametrize("name", ["sgd", "momentum", "adagrad", "adam"])
def test_every_optimizer_is_accepted(name):
    assert JobSpec.from_mapping({"optimizer": name}).optimizer == name


# ---- files -------------------------------------------------------------------------------

def test_from_yaml_file(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("epochs: 3\nbatch-size: 16\nhidden: 128,64\noptimizer: sgd\nlr: 0.1\n")
    job = JobSpec.from_file(str(path))
    assert (job.epochs, job.batch_size, job.hidden, job.optimizer, job.lr) == (
        3, 16, (128, 64), "sgd", 0.1)
    assert job.data == "digits"  # the rest are defaults


def test_from_json_file(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"epochs": 2, "hidden": [32], "tasks_per_epoch": 4}))
    job = JobSpec.from_file(str(path))
    assert (job.epochs, job.hidden, job.tasks_per_epoch) == (2, (32,), 4)


def test_missing_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(JobError) as caught:
        JobSpec.from_file(str(path))
    assert str(path) in str(caught.value)


def test_invalid_yaml_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("epochs: [1, 2\nlr: :\n")
    with pytest.raises(JobError) as caught:
        JobSpec.from_file(str(path))
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("text", ["- 1\n- 2\n", "42\n", "", "just a string\n"])
def test_non_mapping_file_is_refused(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(JobError) as caught:
        JobSpec.from_file(str(path))
    assert str(path) in str(caught.value)


def test_bad_field_in_file_names_file_and_field(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("epochs: 0\n")
    with pytest.raises(JobError) as caught:
        JobSpec.from_file(str(path))
    assert caught.value.field == "epochs"
    assert str(path) in str(caught.value) and "epochs" in str(caught.value)


def test_unknown_key_in_file_names_it(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("epochs: 2\nwarmup: 5\n")
    with pytest.raises(JobError) as caught:
        JobSpec.from_file(str(path))
    assert "warmup" in str(caught.value)


# ---- flags -------------------------------------------------------------------------------

def parse(*argv: str) -> JobSpec | None:
    parser = argparse.ArgumentParser()
    add_job_arguments(parser)
    return job_from_args(parser.parse_args(list(argv)))


def test_no_flags_means_no_job():
    assert parse() is None


def test_one_flag_gives_a_job_with_defaults_for_the_rest():
    job = parse("--epochs", "3")
    assert job == dataclasses.replace(JobSpec(), epochs=3)


def test_all_flags():
    job = parse("--model", "logreg", "--hidden", "8,4", "--data", "synthetic", "--epochs", "2",
                "--batch-size", "7", "--optimizer", "momentum", "--lr", "0.2", "--mode", "async",
                "--seed", "5", "--tasks-per-epoch", "3", "--evaluate-every", "0")
    assert job == JobSpec(model="logreg", hidden=(8, 4), data="synthetic", epochs=2,
                          batch_size=7, optimizer="momentum", lr=0.2, mode="async", seed=5,
                          tasks_per_epoch=3, evaluate_every=0)


@pytest.mark.parametrize("argv, flag", [
    (["--batch-size", "-1"], "--batch-size"),
    (["--epochs", "0"], "--epochs"),
    (["--tasks-per-epoch", "0"], "--tasks-per-epoch"),
    (["--evaluate-every", "-2"], "--evaluate-every"),
    (["--optimizer", "rmsprop"], "--optimizer"),
    (["--lr", "0"], "--lr"),
])
def test_bad_flag_is_refused_naming_the_flag(argv, flag):
    with pytest.raises(JobError) as caught:
        parse(*argv)
    assert flag in str(caught.value)


def test_bad_hidden_flag_names_the_field():
    with pytest.raises(JobError) as caught:
        parse("--hidden", "a,b")
    assert "hidden" in str(caught.value)


def test_job_file_with_flags_overriding(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("epochs: 4\nbatch_size: 16\n")
    job = parse("--job", str(path), "--epochs", "2")
    assert (job.epochs, job.batch_size) == (2, 16)


def test_job_file_alone(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("epochs: 4\n")
    assert parse("--job", str(path)) == dataclasses.replace(JobSpec(), epochs=4)


def test_bad_field_in_job_file_names_the_file_not_a_flag(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("epochs: 0\n")
    with pytest.raises(JobError) as caught:
        parse("--job", str(path))
    assert caught.value.field == "epochs"
    assert str(path) in str(caught.value)


# ---- JSON --------------------------------------------------------------------------------

@pytest.mark.parametrize("job", [
    JobSpec(),
    JobSpec(model="logreg", hidden=(128, 64), data="synthetic", epochs=3, batch_size=8,
            optimizer="sgd", lr=0.25, seed=7, tasks_per_epoch=2, evaluate_every=3),
])
def test_json_round_trip(job):
    text = job.to_json()
    assert isinstance(json.loads(text), dict)
    assert JobSpec.from_json(text) == job


def test_evaluate_every_is_written_only_when_set():
    """A job that keeps the default reads the same to workers and tools that predate it."""
    assert "evaluate_every" not in json.loads(JobSpec().to_json())
    assert json.loads(JobSpec(evaluate_every=0).to_json())["evaluate_every"] == 0


# ---- known bugs --------------------------------------------------------------------------

@pytest.mark.parametrize("value", [1.5, {"a": 1}])
def test_hidden_of_another_type_names_the_field(value):
    with pytest.raises(JobError) as caught:
        JobSpec.from_mapping({"hidden": value})
    assert caught.value.field == "hidden"


def test_bad_flag_keeps_the_typed_field():
    with pytest.raises(JobError) as caught:
        parse("--batch-size", "-1")
    assert caught.value.field == "batch_size"


def test_infinite_lr_is_refused():
    with pytest.raises(JobError) as caught:
        JobSpec.from_mapping({"lr": float("inf")})
    assert caught.value.field == "lr"


@pytest.mark.parametrize("text,expected", [
    ("30s", Interval(seconds=30.0)), ("2.5", Interval(seconds=2.5)),
    ("5m", Interval(seconds=300.0)), ("500steps", Interval(steps=500)),
    ("1 step", Interval(steps=1)),
])
def test_checkpoint_intervals_are_seconds_or_steps(text, expected):
    assert Interval.parse(text) == expected


@pytest.mark.parametrize("text", ["0s", "soon", "-5", "1.5steps", ""])
def test_a_bad_checkpoint_interval_names_the_flag(text):
    with pytest.raises(ValueError, match="--checkpoint-every"):
        Interval.parse(text)


# ---- defaults that depend on the model ----------------------------------------------------

CTR_DEFAULTS = {"data": "synthetic_ctr", "hidden": (64, 32), "epochs": 5, "batch_size": 512}


def test_embedding_mlp_has_defaults_of_its_own_from_flags_files_and_mappings(tmp_path):
    flags = parse("--model", "embedding_mlp")
    path = tmp_path / "job.yaml"
    path.write_text("model: embedding_mlp\n")
    for job in (flags, parse("--job", str(path)), JobSpec.from_mapping({"model": "embedding_mlp"})):
        assert {k: getattr(job, k) for k in CTR_DEFAULTS} == CTR_DEFAULTS
        assert (job.lr, job.optimizer, job.tasks_per_epoch) == (0.002, "adam", 8)


def test_what_the_user_gives_beats_the_models_defaults(tmp_path):
    job = parse("--model", "embedding_mlp", "--epochs", "2", "--data", "synthetic_ctr:5000")
    assert (job.epochs, job.data, job.batch_size) == (2, "synthetic_ctr:5000", 512)
    path = tmp_path / "job.yaml"
    path.write_text("model: embedding_mlp\nbatch-size: 64\n")
    assert parse("--job", str(path), "--hidden", "8").batch_size == 64
    assert parse("--job", str(path), "--hidden", "8").hidden == (8,)
    assert parse("--job", str(path), "--batch-size", "32").batch_size == 32


def test_model_defaults_survive_the_json_round_trip_and_leave_other_models_alone():
    job = JobSpec.from_mapping({"model": "embedding_mlp", "epochs": 1})
    assert JobSpec.from_json(job.to_json()) == job
    assert parse("--model", "mlp") == dataclasses.replace(JobSpec(), model="mlp")
    assert JobSpec.from_mapping({"model": "logreg"}).data == "digits"


@pytest.mark.parametrize("data", ["synthetic_ctr", "synthetic_ctr:1000"])
def test_synthetic_ctr_is_a_data_set(data):
    assert JobSpec(model="embedding_mlp", data=data).data == data


def test_a_malformed_synthetic_ctr_is_refused():
    with pytest.raises(JobError) as caught:
        JobSpec(data="synthetic_ctr:many")
    assert caught.value.field == "data"


@pytest.mark.parametrize("mode", ["async", "ssp:0", "ssp:2", "sync", "SSP:3"])
def test_consistency_modes_are_accepted_as_given(mode):
    assert JobSpec.from_mapping({"mode": mode}).mode == mode


def test_sync_is_refused_for_a_model_with_embedding_tables():
    with pytest.raises(JobError) as caught:
        JobSpec.from_mapping({"model": "embedding_mlp", "mode": "sync"})
    assert caught.value.field == "mode" and "ssp:K" in str(caught.value)
    assert JobSpec.from_mapping({"model": "embedding_mlp", "mode": "ssp:1"}).mode == "ssp:1"
