"""recipes/configs/mnist_fast.yaml: AdamW, a one-cycle schedule stepped per optimizer step and a
random shift drawn on the device. A stopped and resumed run ends with the same weights as one
that ran through, as with the defaults (tests/test_resume.py). A checkpoint of one cycle length
refuses a run of another (one line): test_invariants.py."""

import pytest
from conftest import stopped_at
from test_resume import assert_identical, train, weights

FAST = ["--config", "recipes/configs/mnist_fast.yaml"]  # COMMON then sets epochs and batch sizes


@pytest.mark.slow
def test_the_fast_preset_resumes_mid_epoch_bit_exactly(tiny_mnist, tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    res = train(
        tiny_mnist,
        straight,
        *FAST,
        "--max_steps",
        13,
        "--checkpoint_every_steps",
        5,
        "--keep_checkpoints",
        5,
    )  # 8 steps an epoch, a 16-step cycle
    assert "lr 0.004" in res.output
    stopped_at(straight, 5, split)  # mid-epoch 1
    res = train(tiny_mnist, split, *FAST, "--max_steps", 13, "--resume", "latest")
    assert "(epoch 1, step 5)" in res.output
    assert_identical(weights(straight), weights(split))
