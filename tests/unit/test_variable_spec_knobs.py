"""A VariableSpec holds every knob of its optimizer and initializer, defaults filled in, so
that a default spelled out is the same spec; it is written (on the wire, in a checkpoint's
manifest) as it was declared, as older versions wrote it, and reads back as the same spec."""

from __future__ import annotations

from ps_common.checkpoints import spec_from_json, spec_to_json
from ps_common.shardmap import Component, VariableSpec
from ps_common.wire import spec_from_proto, spec_to_proto


def spec(optimizer, init="zeros") -> VariableSpec:
    return VariableSpec("w", (4, 2), initializer=Component.of(init),
                        optimizer=Component.of(optimizer))


def test_a_default_spelled_out_is_the_same_spec():
    assert spec("adam") == spec({"name": "adam", "lr": 0.001, "eps": 1e-8})
    assert spec({"name": "sgd", "lr": 0.5}) == spec({"name": "sgd", "lr": 0.5,
                                                     "weight_decay": 0.0})
    assert spec("sgd", init="uniform") == spec(
        "sgd", init={"name": "uniform", "minval": -0.05, "maxval": 0.05})
    assert VariableSpec("w", (4, 2)) == spec({"name": "sgd", "lr": 0.01})
    assert spec({"name": "adam", "lr": 0.01}) != spec("adam")


def test_it_is_written_as_declared_and_reads_back_the_same():
    """Older versions compare knob for knob: a spec is written with the knobs it was given
    (ps-worker declares {"name": ..., "lr": ...} whatever the lr), never with defaults added
    or taken away; messages show the knobs that differ from their defaults."""
    declared = spec({"name": "adam", "lr": 0.001, "beta1": 0.5},
                    init={"name": "normal", "stddev": 0.1})
    on_the_wire = spec_to_proto(declared)
    assert dict(on_the_wire.optimizer.params) == {"lr": 0.001, "beta1": 0.5}
    assert dict(on_the_wire.initializer.params) == {"stddev": 0.1}
    assert spec_from_proto(on_the_wire) == declared
    assert dict(spec_to_proto(spec_from_proto(on_the_wire)).optimizer.params) == {
        "lr": 0.001, "beta1": 0.5}
    in_a_manifest = spec_to_json(declared)
    assert in_a_manifest["optimizer"] == {"name": "adam", "lr": 0.001, "beta1": 0.5}
    assert spec_from_json(in_a_manifest) == declared
    assert spec_to_json(spec("adam"))["optimizer"] == {"name": "adam"}
    assert "optimizer=adam(beta1=0.5)" in declared.describe()


def test_unknown_names_and_knobs_are_kept_as_given_for_the_checks_that_refuse_them():
    odd = VariableSpec("w", (2,), optimizer=Component.of({"name": "adam", "speed": 2.0}))
    assert dict(odd.optimizer.params) == {"speed": 2.0}
    assert VariableSpec("w", (2,), optimizer=Component("rmsprop")).optimizer == Component(
        "rmsprop")
