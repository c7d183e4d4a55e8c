"""Models a worker can train: built-ins (``logreg``, ``mlp``, ``embedding_mlp``) and user
models by reference."""

from ps_worker.models.base import (
    INITIALIZER_KNOBS,
    EmbeddingDef,
    EmbeddingModel,
    EvaluableModel,
    Model,
    ScoringModel,
    VariableDef,
)
from ps_worker.models.dense import MLP, LogisticRegression
from ps_worker.models.embedding import EmbeddingMLP
from ps_worker.models.initializers import initial_values
from ps_worker.models.registry import BUILTIN_MODELS, build_model

__all__ = [
    "BUILTIN_MODELS",
    "INITIALIZER_KNOBS",
    "MLP",
    "EmbeddingDef",
    "EmbeddingMLP",
    "EmbeddingModel",
    "EvaluableModel",
    "LogisticRegression",
    "Model",
    "ScoringModel",
    "VariableDef",
    "build_model",
    "initial_values",
]
