"""The training job: what every worker runs. Given to ps-coordinator / ps-cluster as flags
or as a YAML/JSON file with the same keys; validated once, at start, with errors that name
the field. Pure: no grpc."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import yaml

from ps_common.consistency import SYNC, parse_mode

OPTIMIZER_NAMES = ("sgd", "momentum", "adagrad", "adam")
BUILTIN_MODELS = ("logreg", "mlp", "embedding_mlp")
BUILTIN_DATA = ("digits", "synthetic", "synthetic_ctr")
# Checked here by form only: the file or module may exist on the workers' machines alone.
# A worker that cannot load them reports it, and the coordinator fails the job.
_MODEL_REFERENCE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
_SYNTHETIC_N = re.compile(r"^synthetic(_ctr)?:\d+$")
# Defaults that depend on the model: a job that names the model but not these fields (in
# flags, a job file or a mapping) gets these instead of the JobSpec defaults, which suit
# the dense models on digits. The click-through model's: its held-out AUC levels off in
# 4 to 5 epochs of batches of 512 (about 17 s on 2 cores; README, "Click-through model").
MODEL_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "embedding_mlp": {"data": "synthetic_ctr", "hidden": (64, 32), "epochs": 5,
                      "batch_size": 512},
}

# Epochs and tasks travel as int32 (coordinator.proto: JobStatus, TaskInfo).
MAX_INT32 = 2**31 - 1
# A variable's seed on the wire (VariableSpec.seed, an int64) is the job's seed plus the
# variable's own offset (VariableDef/EmbeddingDef.seed; the built-in models' are below 100):
# offsets are kept below 2**32, and the job's seed leaves room for the largest of them.
MAX_SEED_OFFSET = 2**32 - 1
MAX_SEED = 2**63 - 1 - MAX_SEED_OFFSET


class JobError(ValueError):
    """A job field is wrong; the message names the field (and the file, if any)."""

    def __init__(self, message: str, *, field: str | None = None, problem: str = ""):
        super().__init__(message)
        self.field = field
        self.problem = problem


# float32's largest finite value and its smallest positive one (a subnormal).
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINIEST = 1.401298464324817e-45

@dataclass(frozen=True)
class JobSpec:
    model: str = "mlp"
    hidden: tuple[int, ...] = (64,)
    data: str = "digits"
    epochs: int = 10
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 0.002
    mode: str = "async"
    seed: int = 0
    tasks_per_epoch: int = 8
    # Evaluate the held-out split after every N-th epoch and after the last; 0: never. An
    # epoch that is not evaluated does not hold up the next one (see `evaluates`).
    evaluate_every: int = 1
    # Where the coordinator keeps checkpoints (its --checkpoint-dir wins); "" for none.
    checkpoint_dir: str = ""
    # Workers on a server's host pull and push through shared memory where the server offers
    # it; False: every worker uses gRPC (ps-coordinator --no-shm).
    shared_memory: bool = True

    def __post_init__(self):
        def need(ok: bool, field: str, want: str):
            if not ok:
                problem = f"{getattr(self, field)!r} {want}"
                raise JobError(f"job field {field!r}: {problem}", field=field, problem=problem)

        need(isinstance(self.model, str) and (self.model in BUILTIN_MODELS
                                              or bool(_MODEL_REFERENCE.match(self.model))),
             "model", "must be 'logreg', 'mlp', 'embedding_mlp' or 'module:attribute'")
        need(all(_integer(h) and h > 0 for h in self.hidden), "hidden",
             "must be positive integers, e.g. 128,64")
        need(isinstance(self.data, str) and (self.data in BUILTIN_DATA
                                             or bool(_SYNTHETIC_N.match(self.data))
                                             or self.data.endswith(".npz")), "data",
             "must be 'digits', 'synthetic', 'synthetic:N', 'synthetic_ctr', 'synthetic_ctr:N' "
             "or a path to an .npz file")
        need(_integer(self.epochs) and 1 <= self.epochs <= MAX_INT32, "epochs",
             f"must be an integer from 1 to {MAX_INT32} (an int32 on the wire)")
        need(_integer(self.batch_size) and self.batch_size >= 1, "batch_size",
             "must be an integer >= 1")
        need(self.optimizer in OPTIMIZER_NAMES, "optimizer", f"must be one of {OPTIMIZER_NAMES}")
        # The job's variables are float32, and the servers refuse an lr that float32 holds
        # as inf or 0 (ps_server.optimizers): refused here, before any worker declares.
        need(isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool)
             and math.isfinite(self.lr) and _FLOAT32_TINIEST <= self.lr <= _FLOAT32_MAX, "lr",
             f"must be a number > 0 that float32, the variables' dtype, holds (at most "
             f"{_FLOAT32_MAX:.4g})")
        need(_mode_kind(self.mode) is not None, "mode",
             "must be async, ssp:K (K an integer >= 0) or sync")
        need(not (self.model == "embedding_mlp" and _mode_kind(self.mode) == SYNC), "mode",
             "cannot train embedding_mlp: sync averages whole variables, and embedding tables "
             "are pushed by row; use async or ssp:K")
        need(_integer(self.seed) and 0 <= self.seed <= MAX_SEED, "seed",
             f"must be an integer from 0 to {MAX_SEED} (an int64 on the wire, with room for "
             f"each variable's seed offset)")
        need(_integer(self.tasks_per_epoch) and 1 <= self.tasks_per_epoch <= MAX_INT32,
             "tasks_per_epoch", f"must be an integer from 1 to {MAX_INT32} (an int32 on the "
             "wire)")
        need(_integer(self.evaluate_every) and 0 <= self.evaluate_every <= MAX_INT32,
             "evaluate_every", f"must be an integer from 0 to {MAX_INT32} (0: never evaluate)")
        need(isinstance(self.checkpoint_dir, str), "checkpoint_dir", "must be a path")
        need(isinstance(self.shared_memory, bool), "shared_memory", "must be true or false")

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any], *, source: str = "job") -> "JobSpec":
        """The job of these fields; those it omits take the model's defaults
        (MODEL_DEFAULTS), then JobSpec's."""
        known = {f.name for f in dataclasses.fields(cls)}
        normalized = _normalized(values)
        unknown = sorted(set(normalized) - known)
        if unknown:
            raise JobError(f"{source}: unknown field(s) {unknown}; known: {sorted(known)}")
        model = normalized.get("model", cls.model)
        if isinstance(model, str):
            for key, value in MODEL_DEFAULTS.get(model, {}).items():
                normalized.setdefault(key, value)
        if "hidden" in normalized:
            normalized["hidden"] = _parse_hidden(normalized["hidden"], source)
        try:
            return cls(**normalized)
        except JobError as error:
            raise JobError(f"{source}: {error}", field=error.field, problem=error.problem) from None

    @classmethod
    def from_file(cls, path: str) -> "JobSpec":
        return cls.from_mapping(_read_job_file(path), source=f"--job {path}")

    def evaluates(self, epoch: int) -> bool:
        """Whether the held-out split is evaluated after `epoch` (1-based): every
        `evaluate_every`-th epoch and the last, so that the job ends with a held-out figure.
        The coordinator starts an epoch that follows an evaluated one only once the
        evaluation has read the parameters it measures; any other epoch starts as soon as
        every task of the one before has been handed out, so no worker waits at its end."""
        every = self.evaluate_every
        return every > 0 and (epoch % every == 0 or epoch == self.epochs)

    def evaluations(self) -> int:
        """How many epochs are evaluated."""
        every = self.evaluate_every
        return 0 if every == 0 else self.epochs // every + (self.epochs % every != 0)

    def to_json(self) -> str:
        values = dataclasses.asdict(self)
        # Written only when set: a job that keeps the default reads the same to workers and
        # tools that predate the field (and to a coordinator's saved state).
        if values["evaluate_every"] == 1:
            del values["evaluate_every"]
        return json.dumps(values, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        return cls.from_mapping(json.loads(text))


def _mode_kind(mode: Any) -> str | None:
    try:
        return parse_mode(mode).kind if isinstance(mode, str) else None
    except ValueError:
        return None


def _integer(value) -> bool:
    """An int, and not a bool (which is one to Python: `epochs: true` is no count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _normalized(values: Mapping[str, Any]) -> dict[str, Any]:
    return {str(k).replace("-", "_"): v for k, v in values.items()}


class _JobFileLoader(yaml.SafeLoader):
    """YAML as PyYAML reads it (YAML 1.1), but for numbers in exponent notation without a
    dot (`lr: 1e-3`), which YAML 1.1 reads as strings and JSON and YAML 1.2 as floats."""


_JobFileLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


def _read_job_file(path: str) -> dict[str, Any]:
    """The mapping a job file holds, or JobError naming the file."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise JobError(f"--job {path}: cannot read it: {error.strerror}") from None
    except UnicodeDecodeError:
        raise JobError(f"--job {path}: not UTF-8 text (a job file is YAML or JSON)") from None
    try:
        values = yaml.load(text, Loader=_JobFileLoader)  # YAML is a superset of JSON
    except yaml.YAMLError as error:
        raise JobError(f"--job {path}: not valid YAML/JSON: {error}") from None
    if not isinstance(values, dict):
        raise JobError(f"--job {path}: must hold a mapping of job fields")
    return values


def _parse_hidden(value: Any, source: str) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,)
    if isinstance(value, str):
        try:
            return tuple(int(v) for v in value.split(",") if v.strip())
        except ValueError:
            raise JobError(f"{source}: job field 'hidden': {value!r} is not like 128,64",
                           field="hidden", problem=f"{value!r} is not like 128,64") from None
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise JobError(f"{source}: job field 'hidden': {value!r} is not like 128,64",
                   field="hidden", problem=f"{value!r} is not like 128,64")


# ---- command line ------------------------------------------------------------------------

JOB_FLAGS = ("model", "hidden", "data", "epochs", "batch_size", "optimizer", "lr", "mode",
             "seed", "tasks_per_epoch", "evaluate_every")


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """The job flags; any of them (or --job) gives the coordinator a job to run."""
    g = parser.add_argument_group("job (any of these gives the coordinator a job; defaults: "
                                  "the MLP on the digits data set)")
    g.add_argument("--job", metavar="FILE", help="YAML or JSON file with the job fields below")
    g.add_argument("--model", help="logreg | mlp | embedding_mlp | module:attribute (default "
                   "mlp; embedding_mlp changes the defaults of --data, --hidden, --epochs and "
                   "--batch-size to synthetic_ctr, 64,32, 5 and 512)")
    g.add_argument("--hidden", help="hidden layer sizes of the mlp, e.g. 128,64 (default 64)")
    g.add_argument("--data", help="digits | synthetic[:N] | synthetic_ctr[:N] | PATH.npz "
                   "(default digits)")
    g.add_argument("--epochs", type=int)
    g.add_argument("--batch-size", type=int)
    g.add_argument("--optimizer", help=f"one of {', '.join(OPTIMIZER_NAMES)} (default adam)")
    g.add_argument("--lr", type=float)
    g.add_argument("--mode", help="consistency mode: async (default: no bound), ssp:K (no "
                   "worker more than K steps ahead of the slowest) or sync (one averaged "
                   "gradient from every worker per step); see the README")
    g.add_argument("--seed", type=int)
    g.add_argument("--tasks-per-epoch", type=int)
    g.add_argument("--evaluate-every", type=int, metavar="N",
                   help="evaluate the held-out split after every N-th epoch and after the "
                   "last (default 1: every epoch); 0: never. An epoch that is not evaluated "
                   "does not hold up the next one")


def job_from_args(args: argparse.Namespace) -> JobSpec | None:
    """The job the flags describe (file first, flags override), or None if none was given.
    Fields that neither sets take the model's defaults, then JobSpec's."""
    given = {k: getattr(args, k) for k in JOB_FLAGS if getattr(args, k, None) is not None}
    if args.job is None and not given:
        return None
    from_file: dict[str, Any] = {}
    if args.job is not None and not args.job.strip():
        # An unset variable in a templated `--job "$JOB"`: not a request for the defaults.
        raise JobError("--job: an empty path; name a job file, or leave --job out")
    if args.job:
        JobSpec.from_file(args.job)  # the file's own mistakes are named as the file's
        from_file = _normalized(_read_job_file(args.job))
    values = {**from_file, **given}
    try:
        return JobSpec.from_mapping(values, source="job flags")
    except JobError as error:
        if error.field in given:  # name the flag as the user typed it
            raise JobError(f"--{error.field.replace('_', '-')}: {error.problem}",
                           field=error.field, problem=error.problem) from None
        raise
