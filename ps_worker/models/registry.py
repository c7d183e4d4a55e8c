"""``build_model``: from a ``--model`` value to a model object."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Sequence
from typing import Any

from ps_worker.models.base import EmbeddingDef, Model, VariableDef
from ps_worker.models.dense import MLP, LogisticRegression
from ps_worker.models.embedding import EmbeddingMLP

__all__ = ["BUILTIN_MODELS", "build_model", "find_models_in"]

BUILTIN_MODELS = ("logreg", "mlp", "embedding_mlp")
# The embedding table's optimizer in the built-in embedding_mlp, whatever the job's (which
# the dense layers use): per-row step sizes suit rows that are updated rarely and unevenly.
# On synthetic_ctr (README, "Click-through model"), Adam at the job's lr 0.002 peaked at
# held-out AUC 0.838 in epoch 2 and fell to 0.826 by epoch 5 (it memorizes rare ids);
# Adagrad at lr 0.1 rose to 0.835 and stayed there (0.02: 0.826, 0.05: 0.833 at epoch 5).
EMBEDDING_MLP_TABLE_OPTIMIZER = {"name": "adagrad", "lr": 0.1}


def build_model(
    name_or_ref: str,
    *,
    num_features: int,
    num_classes: int,
    hidden: Sequence[int] = (128, 64),
    field_sizes: Sequence[int] = (),
) -> Model:
    """A built-in model by name (``"logreg"``, ``"mlp"``, ``"embedding_mlp"``) or a user
    model ``"module:attribute"``.

    ``field_sizes`` are the vocabulary sizes of the data set's categorical fields (empty for
    a data set of dense features only): ``embedding_mlp`` needs them and binary labels, the
    dense built-ins refuse them. A user attribute that is a class, or a callable that is not
    already a model, is called with those of ``num_features``, ``num_classes``, ``hidden``
    and ``field_sizes`` that it accepts; anything else is used as the model itself. Raises
    ``ValueError`` naming ``name_or_ref`` when the name is unknown, does not fit the data,
    the import or the call fails, or the result is not a model.
    """
    field_sizes = tuple(field_sizes)
    if name_or_ref in ("logreg", "mlp") and field_sizes:
        raise ValueError(
            f"model {name_or_ref!r} takes dense features only, and the data set has "
            f"{len(field_sizes)} categorical field(s): use 'embedding_mlp'"
        )
    if name_or_ref == "logreg":
        return LogisticRegression(num_features, num_classes)
    if name_or_ref == "mlp":
        return MLP(num_features, num_classes, hidden=tuple(hidden))
    if name_or_ref == "embedding_mlp":
        if not field_sizes:
            raise ValueError(
                "model 'embedding_mlp' needs a data set with categorical fields "
                "(e.g. synthetic_ctr)"
            )
        if num_classes != 2:
            raise ValueError(
                f"model 'embedding_mlp' needs binary labels (0/1); the data set has "
                f"{num_classes} classes"
            )
        return EmbeddingMLP(
            num_features, field_sizes, hidden=tuple(hidden),
            table_optimizer=EMBEDDING_MLP_TABLE_OPTIMIZER,
        )
    if ":" not in name_or_ref:
        raise ValueError(
            f"model {name_or_ref!r} is not one of {list(BUILTIN_MODELS)} "
            "nor a 'module:attribute' reference"
        )
    target = _resolve(name_or_ref)
    if inspect.isclass(target) or (callable(target) and not _looks_like_model(target)):
        kwargs = _accepted_kwargs(
            target,
            {
                "num_features": num_features,
                "num_classes": num_classes,
                "hidden": tuple(hidden),
                "field_sizes": field_sizes,
            },
        )
        try:
            target = target(**kwargs)
        except Exception as exc:  # user code: any failure is a configuration error
            raise ValueError(f"model {name_or_ref!r}: constructing it failed: {exc!r}") from exc
    _check_model(name_or_ref, target)
    return target


def find_models_in(directory: str) -> None:
    """Let ``module:attribute`` references name a module in ``directory``, as
    ``PYTHONPATH=directory`` would: it goes on ``sys.path`` right after the entry of the
    running script, unless it is there already (``python -m`` puts the working directory
    there; an installed ``ps-worker`` or ``ps-cluster`` command does not). The commands call
    it with their working directory. Not thread-safe: call it before starting threads."""
    directory = os.path.abspath(directory)
    if directory not in (os.path.abspath(entry or os.curdir) for entry in sys.path):
        sys.path.insert(min(1, len(sys.path)), directory)


def _resolve(reference: str) -> Any:
    module_name, _, attribute_path = reference.partition(":")
    if not module_name or not attribute_path:
        raise ValueError(f"model reference {reference!r} must look like 'module:attribute'")
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # user code: a failing import is a configuration error
        raise ValueError(f"model {reference!r}: cannot import {module_name!r}: {exc!r}") from exc
    for attribute in attribute_path.split("."):
        try:
            target = getattr(target, attribute)
        except AttributeError:
            raise ValueError(
                f"model {reference!r}: {module_name!r} has no attribute {attribute_path!r}"
            ) from None
    return target


def _looks_like_model(candidate: Any) -> bool:
    return callable(getattr(candidate, "variables", None)) and callable(
        getattr(candidate, "loss_and_grads", None)
    )


def _accepted_kwargs(factory: Any, offered: dict[str, Any]) -> dict[str, Any]:
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no introspectable signature: offer nothing
        return {}
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return dict(offered)
    accepted = {
        parameter.name
        for parameter in parameters
        if parameter.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {name: value for name, value in offered.items() if name in accepted}


def _called(reference: str, model: Any, method: str) -> list:
    """`model.<method>()` as a list; what it raises is the model's fault (ValueError)."""
    try:
        return list(getattr(model, method)())
    except Exception as error:  # noqa: BLE001 - any failure of user code is reported
        raise ValueError(f"model {reference!r}: {method}() raised "
                         f"{type(error).__name__}: {error}") from error


def _check_model(reference: str, model: Any) -> None:
    if not _looks_like_model(model):
        raise ValueError(f"model {reference!r} has no callable variables() and loss_and_grads()")
    variables = _called(reference, model, "variables")
    names = [getattr(variable, "name", None) for variable in variables]
    if not all(isinstance(variable, VariableDef) for variable in variables) or not all(
            isinstance(name, str) and name for name in names):
        raise ValueError(
            f"model {reference!r}: variables() must return named VariableDefs, got "
            f"{variables!r}"
        )
    tables = _called(reference, model, "tables") \
        if callable(getattr(model, "tables", None)) else []
    if not variables and not tables:
        raise ValueError(f"model {reference!r}: variables() and tables() return nothing to "
                         "train")
    if tables:
        if not all(isinstance(table, EmbeddingDef) for table in tables):
            raise ValueError(
                f"model {reference!r}: tables() must return EmbeddingDefs, got {tables!r}"
            )
        if not callable(getattr(model, "row_ids", None)):
            raise ValueError(f"model {reference!r} has tables() but no callable row_ids()")
        names += [table.name for table in tables]
    if len(set(names)) != len(names):
        raise ValueError(f"model {reference!r}: variables() and tables() repeat a name: {names}")
