"""Deterministic mode (common/determinism.py): the flags that --deterministic sets, and those it
leaves alone."""

import os

import pytest
import torch

from common.determinism import set_deterministic


@pytest.fixture
def restore_determinism():
    """Put torch's determinism flags and CUBLAS_WORKSPACE_CONFIG back as they were."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None),
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]
    os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    if saved[4] is not None:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = saved[4]


def test_deterministic_mode_sets_the_flags(restore_determinism):
    set_deterministic(True)
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    set_deterministic(False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark
    set_deterministic(False, benchmark=False)  # what the U-Net's bucket_by_size asks for
    assert not torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_deterministic_mode_keeps_a_workspace_setting_of_the_user(restore_determinism):
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":16:8"
    set_deterministic(True)
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
