"""ONNX export: a recipe's weights as an .onnx file beside them, checked against PyTorch, and a
callable that runs such a file with onnxruntime where predict runs the torch model.

    model = BasicNet(); load_weights(model, cfg.weights)
    export_onnx(
        accelerator, model, inputs=[x, x[:1]], weights=cfg.weights, metadata={"recipe": "mnist"},
        dynamic={0: "batch"},   # axes of any size
    )
    logits = OnnxModel("runs/mnist/model.onnx")(x)   # float NCHW tensor in, logits tensor out
    onnx_metadata("runs/mnist/model.onnx")           # the weights file's metadata, carried over

The graph comes from torch.onnx.export(dynamo=True), torch's default exporter since 2.9 (the
TorchScript one is deprecated), which needs the onnxscript package; with onnx and onnxruntime
it is in requirements-extras.txt. They are imported when used, never when a recipe starts.
"""

import importlib
import os
from pathlib import Path

import torch
from safetensors import safe_open

from common.config import UserError

TOLERANCE = 1e-4  # fp32: max |onnxruntime - torch| of any logit; kernels differ in rounding only
INPUT, OUTPUT = "image", "logits"  # the names of the graph's input and output


def require_packages(purpose, *names):
    """Import the packages `names`; one that is not installed stops with one line."""
    modules = []
    for name in names:
        try:
            modules.append(importlib.import_module(name))
        except ModuleNotFoundError as e:
            if e.name != name:  # a package that is there failed to import one of its own
                raise
            raise UserError(
                f"{purpose} needs the {name} package: pip install -r requirements-extras.txt"
            ) from None
    return modules


def weights_metadata(path):
    """The metadata of a .safetensors weights file; {} for a torch.save'd state_dict."""
    if Path(path).suffix != ".safetensors":
        return {}
    with safe_open(path, "pt") as f:  # load_weights has read the file already: it is whole
        return f.metadata() or {}


def onnx_metadata(path):
    """The metadata_props of an .onnx file, as {key: value}."""
    (onnx,) = require_packages(f"reading {path}", "onnx")
    from google.protobuf.message import DecodeError  # protobuf comes with onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except DecodeError as e:
        raise UserError(
            f"cannot read {path} ({type(e).__name__}): it is truncated or not an ONNX file"
        ) from None
    return {p.key: p.value for p in model.metadata_props}


class OnnxModel:
    """An .onnx file run by onnxruntime on the CPU, called as the torch model is: a float
    [N, C, H, W] tensor (or int64 token ids [N, L]) in, a logits tensor out on the input's
    device."""

    def __init__(self, path):
        (ort,) = require_packages(f"running {path}", "onnxruntime")
        self.path = Path(path)
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])

    def __call__(self, x):
        x_in = x.detach().cpu()  # float as float32; integer inputs (token ids) as they are
        x_in = x_in.float() if x_in.is_floating_point() else x_in
        name = self.session.get_inputs()[0].name  # INPUT, or the input_name it was written with
        (logits,) = self.session.run([OUTPUT], {name: x_in.numpy()})
        return torch.from_numpy(logits).to(x.device)


def write_onnx(model, example, path, *, metadata, dynamic, input_name=INPUT):
    """Export `model` (on the CPU, in eval mode) traced on `example` to `path`, one file, with
    `metadata` in its metadata_props. dynamic: {axis: name} of the input and output axes that
    take any size, such as {0: "batch"}, or {axis: a torch.export dimension}; the others keep
    the example's size."""
    onnx, _ = require_packages("export onnx", "onnx", "onnxscript")
    # Batch 2 at least: torch.export takes an axis of size 1 for a constant.
    example = example[:1].expand(max(len(example), 2), *example.shape[1:]).contiguous()
    # A name, or a dimension made already (16 * Dim("blocks"): a length in multiples of 16).
    axes = {axis: torch.export.Dim(d) if isinstance(d, str) else d for axis, d in dynamic.items()}
    program = torch.onnx.export(
        model.cpu().eval(),
        (example,),
        dynamo=True,
        input_names=[input_name],
        output_names=[OUTPUT],
        dynamic_shapes=(axes,),
        verbose=False,
    )
    proto = program.model_proto
    onnx.helper.set_model_props(proto, {k: str(v) for k, v in metadata.items()})
    onnx.save(proto, str(path))


@torch.inference_mode()
def check_onnx(model, path, inputs):
    """The largest |onnxruntime - torch| over the logits of each batch of `inputs`; beyond
    TOLERANCE a UserError."""
    session, model = OnnxModel(path), model.cpu().eval()
    worst = max(float((session(x) - model(x)).abs().max()) for x in inputs)
    if not worst <= TOLERANCE:  # also NaN
        sizes = " and ".join("x".join(map(str, x.shape)) for x in inputs)
        raise UserError(
            f"{path} gives logits up to {worst:.2e} away from PyTorch's on inputs of "
            f"{sizes} (tolerance {TOLERANCE:g}): the exporter mistranslated the model"
        )
    return worst


def export_onnx(
    accelerator, model, *, inputs, weights, metadata, dynamic, what="", input_name=INPUT
):
    """Write the weights file `weights` as an .onnx file of the same name beside it, whose
    metadata_props carry the weights file's metadata and `metadata`. Before it takes its name,
    onnxruntime must give PyTorch's logits on each batch of `inputs` (real data; batches of other
    sizes along the `dynamic` axes check that they take any size, see write_onnx). `what`: a few
    words on where the inputs come from, for the report line. input_name: the graph's input
    (a text model's: "tokens")."""
    if accelerator.num_processes > 1:
        raise UserError(
            "export runs on one process: start it with python, not a multi-process launch"
        )
    path = Path(weights).with_suffix(".onnx")
    tmp = path.with_name(f".{path.stem}.tmp.onnx")
    try:
        metadata = {**weights_metadata(weights), **metadata}
        write_onnx(model, inputs[0], tmp, metadata=metadata, dynamic=dynamic, input_name=input_name)
        worst = check_onnx(model, tmp, inputs)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(
            f"cannot write {path} ({e.strerror or e}): copy the weights to a "
            f"folder you can write to"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
    sizes = ", ".join("x".join(map(str, x.shape)) for x in inputs)
    accelerator.print(
        f"wrote {path}: onnxruntime's logits are within {worst:.1e} of PyTorch's "
        f"(max abs, fp32) on inputs of {sizes}{f' ({what})' if what else ''}"
    )
    return path
