"""One default learning rate per kind of model (polar_mitm/train/learning_rate.py): a checkpoint's kind is what its
polar_model.json says, and a training of ours keeps the kind of the model it started from."""

from __future__ import annotations

import json
import shutil

from polar_mitm.train.learning_rate import DEFAULT_LEARNING_RATES, default_learning_rate, model_kind


def test_our_models_and_any_other_checkpoint_each_get_their_own_rate(tiny_model_dir, tmp_path):
    assert model_kind(tiny_model_dir) == "tiny"
    assert default_learning_rate(tiny_model_dir) == (
        5e-3,
        "learning rate 0.005, the default for the tiny model (--learning-rate sets it)",
    )
    other = tmp_path / "qwen"
    shutil.copytree(tiny_model_dir, other)
    (other / "polar_model.json").unlink()  # a checkpoint from elsewhere: no marker of ours
    assert default_learning_rate(other)[0] == DEFAULT_LEARNING_RATES["pretrained"] == 1e-6
    (other / "polar_model.json").write_text(json.dumps({"kind": "smollm2"}))
    assert model_kind(other) == "smollm2"
    (other / "polar_model.json").write_text("not json")
    assert model_kind(other) == "pretrained"
