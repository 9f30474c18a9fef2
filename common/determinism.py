"""A switch between reproducible and fast GPU kernels."""

import os

import torch


def set_deterministic(enabled, benchmark=True):
    """Reproducible kernels (enabled=True) or the fastest ones (enabled=False, the usual default).

    Call it once at start-up, before any CUDA work: cuBLAS reads CUBLAS_WORKSPACE_CONFIG when
    it starts. The seed (`set_seed`) fixes the random numbers; this fixes the arithmetic.

    enabled=True: the same run on the same GPU, software and process count gives the same
    weights, bit for bit. cudnn.benchmark is off (its autotuner may pick a different algorithm
    each run), cudnn.deterministic is on, and cuBLAS gets a fixed workspace
    (CUBLAS_WORKSPACE_CONFIG=:4096:8, unless it is already set, e.g. to the smaller :16:8).
    torch.use_deterministic_algorithms(True) makes an operation with no deterministic GPU
    kernel raise a RuntimeError naming it, rather than vary silently. One that segmentation
    meets: F.cross_entropy on [N, C, H, W] logits with reduction "mean"/"sum" or ignore_index
    (nll_loss2d); take reduction="none" and average the pixels yourself. The cost is speed:
    slower kernels, so longer training steps (docs/performance.md).

    enabled=False: cudnn.benchmark times the convolution algorithms for each new input shape
    and keeps the fastest. With fixed shapes that is the fastest setting; with many different
    shapes (bucketing by native image size) every new shape is timed once, so round the sizes
    to a few values, or pass benchmark=False. Results then vary in the last bits between runs.

    On the CPU it changes little: most CPU kernels are deterministic already.
    """
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Switching it off when it is off already would import torch's compiler for nothing, a slow
    # import (use_deterministic_algorithms sets an inductor option too).
    if enabled or torch.are_deterministic_algorithms_enabled():
        torch.use_deterministic_algorithms(enabled, warn_only=False)
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = benchmark and not enabled
