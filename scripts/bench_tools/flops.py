"""FLOPs of training on one sample, the matrix-product peak of the run's precision, and each
variant's TFLOP/s and fraction of that peak (the U-Net bench)."""

import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from bench_tools.timing import sync


def flops_per_sample(build_model, x, y, loss_fn):
    """FLOPs of training on one sample: forward and backward of the model and loss on a batch of
    two like (x, y), counted by torch.utils.flop_counter (matrix products and convolutions, the
    work that matters) on the meta device, where nothing is computed or stored."""
    with torch.device("meta"):
        model = build_model()
        x, y = torch.empty(2, *x.shape), torch.empty(2, *y.shape, dtype=y.dtype)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model(x), y).backward()
    return counter.get_total_flops() // 2


def peak_dtype(accelerator):
    """The precision of the run's matrix products: fp32, or what mixed_precision asks for
    (the CPU runs fp16 configs in fp32, see common.accelerator.describe)."""
    precision, device = accelerator.mixed_precision, accelerator.device
    if precision == "bf16" or (precision == "fp16" and device.type == "cuda"):
        return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    return torch.float32


def peak_name(device, dtype):
    name = str(dtype).removeprefix("torch.")
    if device.type == "cuda" and dtype == torch.float32 and torch.backends.cudnn.allow_tf32:
        name += " (TF32, as cuDNN convolutions)"
    return name


def matmul_peak(device, dtype, seconds=1.0):
    """TFLOP/s of a large square matrix product in `dtype` on `device`: the peak that the run's
    precision reaches here (8192 x 8192 on a GPU, 1024 x 1024 on a CPU). In fp32 on a GPU the
    product may use TF32 when cuDNN's convolutions do (torch.backends.cudnn.allow_tf32, on by
    default), so that a model in fp32 is compared with the arithmetic it runs in."""
    n = 8192 if device.type == "cuda" else 1024
    tf32 = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda" and dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32
    try:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        out = torch.empty_like(a)
        for _ in range(3):
            torch.mm(a, b, out=out)
        products, start = 0, time.perf_counter()
        while True:
            sync(device)
            if time.perf_counter() - start >= seconds and products:
                break
            for _ in range(10):
                torch.mm(a, b, out=out)
            products += 10
        elapsed = time.perf_counter() - start
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2 * n**3 * products / elapsed / 1e12


def flop_rates(results, flops, peaks):
    """Add to each variant its TFLOP/s (median and best samples/s x FLOPs per sample) and its
    fraction of the matrix-product peak, the higher of those measured. Returns that peak."""
    peak = max(peaks)
    for res in results.values():
        res["tflops"] = round(res["median_samples_per_s"] * flops / 1e12, 4)
        res["tflops_best"] = round(res["best_samples_per_s"] * flops / 1e12, 4)
        res["fraction_of_peak"] = round(res["tflops"] / peak, 4)
        res["fraction_of_peak_best"] = round(res["tflops_best"] / peak, 4)
    return peak
