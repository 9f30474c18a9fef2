"""A switch between reproducible and fast GPU kernels."""

import os

import torch


def set_deterministic(enabled):
    """Reproducible kernels (enabled=True) or the fastest ones (enabled=False, the usual default).

    Call it once at start-up, before any CUDA work: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when
    it starts. The seed (`set_seed`) fixes the random numbers; this fixes the arithmetic.

    enabled=True: the same run on the same GPU, software and process count gives the same
    weights, bit for bit. cudnn.benchmark is off (its autotuner may pick a different algorithm
    each run), cudnn.deterministic is on, torch.use_deterministic_algorithms(True) makes an
    operation with no deterministic GPU implementation raise a RuntimeError that names it
    (rather than vary silently), and cuBLAS gets a fixed workspace (CUBLAS_WORKSPACE_CONFIG
    :4096:8, unless it is already set, e.g. to the smaller :16:8). The cost is speed: often
    10-30% on convolutional networks, more where atomics-based kernels are replaced.

    enabled=False: cudnn.benchmark times the convolution algorithms for each new input shape
    and keeps the fastest. With fixed shapes that is the fastest setting; with many different
    shapes (bucketing by native image size) every new shape is timed once, so round the sizes
    to a few values. Results then vary in the last bits between runs.

    On the CPU the flags change little: CPU kernels are already deterministic.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled
