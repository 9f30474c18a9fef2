"""--export onnx (common/export.py): both recipes write their weights as an .onnx file beside
them, checked against PyTorch, with the weights file's metadata; the U-Net predicts from it."""

import json
import re
import sys
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from conftest import assert_ok, launch, make_shapes, predict_here
from PIL import Image
from recipe_module import load_recipe
from safetensors import safe_open

from common.checkpoint import load_weights
from common.config import ConfigError, UserError, parse_config
from common.export import OnnxModel, check_onnx, export_onnx, write_onnx
from unet import read_trained

MNIST, UNET = "recipes/mnist.py", "recipes/unet.py"
UNET_DATA = ["--val_fraction", 0.2, "--num_workers", 0]  # 20 images: 16 train, 4 validation
ONE_THREAD = {"OMP_NUM_THREADS": "1"}  # on 2 cores a second thread slows these tiny models down
WROTE = re.compile(
    r"wrote (\S+): onnxruntime's logits are within (\S+) of PyTorch's \(max abs, "
    r"fp32\) on inputs of ([^(\n]+?)(?: \((.*)\))?$",
    re.M,
)


def checked(res):
    """(path, max difference, input shapes) from an export's report line."""
    assert_ok(res)
    path, worst, shapes, _ = WROTE.search(res.output).groups()
    return path, float(worst), shapes.split(", ")


def graph_axes(path):
    """The input's and the output's axes: a name where any size goes, else the size."""
    graph = onnx.load(path).graph
    return [
        [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        for v in (graph.input[0], graph.output[0])
    ]


def metadata(path):
    if path.suffix == ".onnx":
        return {p.key: p.value for p in onnx.load(path).metadata_props}
    with safe_open(path, "pt") as f:
        return f.metadata()


def torch_model(recipe, weights):
    """The recipe's model with the weights, on the CPU, in eval mode."""
    module = load_recipe(recipe)
    if recipe == "mnist":
        model = module.BasicNet(num_classes=10)
        load_weights(model, weights)
        return model.eval()
    return load_recipe(f"{recipe}_predict").trained_model(str(weights))[0]


@pytest.fixture(scope="module")
def mnist_weights(tmp_path_factory):
    """A freshly initialised BasicNet's weights, as the recipe saves them (export needs no
    trained model: its check compares two runs of the same weights)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mnist") / "model.safetensors"
    save_file(
        load_recipe("mnist").BasicNet(num_classes=10).state_dict(),
        path,
        metadata={"recipe": "mnist"},
    )
    return path


@pytest.fixture(scope="module")
def unet_weights(tmp_path_factory):
    """A U-Net of base_channels 4 trained for 4 epochs: enough that it predicts shapes."""
    data = make_shapes(tmp_path_factory.mktemp("shapes"), 20, 48)
    out = tmp_path_factory.mktemp("unet")
    assert_ok(
        launch(
            [
                UNET,
                "--dataset",
                data,
                "--output_dir",
                out,
                "--epochs",
                4,
                "--lr",
                1e-2,
                "--batch_size",
                4,
                "--base_channels",
                4,
                *UNET_DATA,
            ],
            launcher="python",
            env=ONE_THREAD,
        )
    )
    return data, out / "model.safetensors"


@pytest.fixture(scope="module")
def unet_onnx(unet_weights):
    """`--export onnx` of the U-Net: (its output, the .onnx file)."""
    data, weights = unet_weights
    res = launch(
        [UNET, "--dataset", data, "--export", "onnx", "--weights", weights, *UNET_DATA],
        launcher="python",
        env=ONE_THREAD,
    )
    return res, weights.with_suffix(".onnx")


@pytest.mark.slow
def test_mnist_export_writes_a_checked_onnx_file_for_any_batch(mnist_weights, tiny_mnist):
    res = launch(
        [MNIST, "--dataset", tiny_mnist, "--export", "onnx", "--weights", mnist_weights],
        launcher="python",
        env=ONE_THREAD,
    )
    path, worst, shapes = checked(res)
    onnx_file = mnist_weights.with_suffix(".onnx")
    assert path == str(onnx_file) and worst <= 1e-4, res
    assert shapes == ["8x1x28x28", "3x1x28x28"]  # test digits, at two batch sizes
    assert graph_axes(onnx_file) == [["batch", 1, 28, 28], ["batch", 10]]
    # The ONNX file records the recipe, and the classes the model was built with (the data's,
    # for weights that record none): predict from it writes their names.
    classes = json.dumps([str(i) for i in range(10)])
    assert metadata(onnx_file) == {"recipe": "mnist", "classes": classes}
    # A third batch size, compared here rather than by the code under test.
    x = torch.randn(5, 1, 28, 28)
    with torch.no_grad():
        difference = OnnxModel(onnx_file)(x) - torch_model("mnist", mnist_weights)(x)
        assert difference.abs().max() <= 1e-4


@pytest.mark.slow
def test_unet_export_takes_any_batch_and_image_size(unet_onnx, unet_weights):
    res, onnx_file = unet_onnx
    path, worst, shapes = checked(res)
    assert path == str(onnx_file) and worst <= 1e-4, res
    # Validation images at the training size, and one at another height and width.
    assert shapes == ["4x3x48x48", "1x3x64x80"], res
    assert graph_axes(onnx_file) == [
        ["batch", 3, "height", "width"],
        ["batch", 4, "height", "width"],
    ]
    stored = metadata(onnx_file)
    assert stored == metadata(unet_weights[1]) and stored["recipe"] == "unet"
    assert json.loads(stored["segmentation"])["model"] == {
        "in_channels": 3,
        "num_classes": 4,
        "encoder": "",
        "base_channels": 4,
        "bilinear": False,
    }
    x = torch.rand(2, 3, 40, 56)  # a size that neither the export nor its check used
    with torch.no_grad():
        difference = OnnxModel(onnx_file)(x) - torch_model("unet", unet_weights[1])(x)
        assert difference.abs().max() <= 1e-4


@pytest.mark.slow
def test_unet_predict_from_onnx_writes_the_same_masks(unet_onnx, unet_weights, tmp_path):
    # As --predict runs it: the weights' record says what to build, or the .onnx file runs.
    data, weights = unet_weights
    for source in (weights, unet_onnx[1]):
        predict_here(load_recipe("unet"), source, f"{data}/imgs/*.png", tmp_path / source.suffix)
    masks = sorted((tmp_path / ".safetensors").iterdir())
    assert len(masks) == 20
    for mask in masks:  # identical files, not merely close
        assert (tmp_path / ".onnx" / mask.name).read_bytes() == mask.read_bytes(), mask.name
    found = set().union(*(np.unique(np.asarray(Image.open(m))).tolist() for m in masks))
    assert len(found) > 1, found  # the model predicts shapes, not background alone


@pytest.mark.slow
def test_a_missing_exporter_package_is_one_line(mnist_weights, tiny_mnist, monkeypatch):
    # What `--export onnx` meets without onnxscript: its one line is any user error's (launched
    # in test_config.py).
    monkeypatch.setitem(sys.modules, "onnxscript", None)  # what `import onnxscript` meets then
    serving = load_recipe("mnist_predict")
    argv = ["--dataset", str(tiny_mnist), "--export", "onnx", "--weights", str(mnist_weights)]
    message = "export onnx needs the onnxscript package: pip install -r requirements-extras.txt"
    with pytest.raises(UserError, match=re.escape(message)):
        serving.serve(parse_config(serving.Config, argv))


@pytest.mark.slow
def test_a_missing_onnxruntime_for_predict_is_one_line(
    unet_onnx, unet_weights, tmp_path, monkeypatch
):
    onnx_file = unet_onnx[1]
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    message = (
        f"running {onnx_file} needs the onnxruntime package: pip install -r requirements-extras.txt"
    )
    with pytest.raises(UserError, match=re.escape(message)):
        predict_here(load_recipe("unet"), onnx_file, f"{unet_weights[0]}/imgs/*.png", tmp_path)


def test_bad_export_settings_are_rejected():
    mnist, unet = load_recipe("mnist"), load_recipe("unet")
    for config, args, message in [
        (mnist, ["--export", "tflite", "--weights", "m.safetensors"], "export must be onnx"),
        (mnist, ["--export", "onnx"], "export needs weights: add --weights PATH/model.safetensors"),
        (
            mnist,
            ["--export", "onnx", "--weights", "m.safetensors", "--eval_only"],
            "choose one of export and eval_only",
        ),
        (mnist, ["--export", "onnx", "--weights", "m.onnx"], "pass the .safetensors"),
        (
            unet,
            ["--export", "onnx", "--weights", "m.safetensors", "--predict", "x.png"],
            "choose one of predict and export",
        ),
        (unet, ["--weights", "m.onnx"], "an .onnx file only predicts"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            parse_config(config.Config, args)


@pytest.mark.slow
def test_export_runs_on_one_process():
    # What export_onnx() says to the main process of a 2-process launch, before it writes anything.
    two = SimpleNamespace(num_processes=2)
    with pytest.raises(UserError, match="export runs on one process: start it with python, not"):
        export_onnx(two, None, inputs=[], weights="m.safetensors", metadata={}, dynamic={})


@pytest.mark.slow
def test_an_export_that_differs_from_torch_is_one_line(tmp_path):
    torch.manual_seed(0)
    conv, x = torch.nn.Conv2d(3, 2, 3), torch.rand(2, 3, 8, 8)
    write_onnx(conv, x, tmp_path / "conv.onnx", metadata={"recipe": "test"}, dynamic={0: "batch"})
    assert check_onnx(conv, tmp_path / "conv.onnx", [x, x[:1]]) <= 1e-4
    with torch.no_grad():
        conv.bias += 1e-3  # the file no longer matches the model
    with pytest.raises(
        UserError,
        match=r"gives logits up to 1\.00e-03 away from PyTorch's on "
        r"inputs of 2x3x8x8 and 1x3x8x8 \(tolerance 0\.0001\)",
    ):
        check_onnx(conv, tmp_path / "conv.onnx", [x, x[:1]])


@pytest.mark.slow
def test_the_unet_check_sees_validation_images_at_two_sizes(unet_weights, tmp_path, monkeypatch):
    data, _ = unet_weights
    unet, serving = load_recipe("unet"), load_recipe("unet_predict")
    cfg = parse_config(unet.Config, ["--dataset", str(data), *map(str, UNET_DATA)])
    for input_size, first, second in [
        ([32, 40], (4, 3, 32, 40), (1, 3, 48, 72)),
        (None, (4, 3, 48, 48), (1, 3, 64, 80)),
    ]:  # None: own size
        record = {"model": {"in_channels": 3}, "mask_values": [0, 85, 170, 255], "scale": 0}
        images, what = serving.export_inputs(cfg, {**record, "input_size": input_size})
        x, y = (unet.prepare_input(t, cfg) for t in images)
        assert (x.shape, y.shape) == (first, second) and what == f"images of {data}"
        assert x.dtype == torch.float32 and 0 <= x.min() < x.max() <= 1
    # No --dataset or --images: random pixels of the size the weights store, also where the
    # recipe's default data, data/shapes, is made (it need not be what the weights learned); for
    # weights of images at their own sizes, which store none, 64x64 (and another size).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "shapes").symlink_to(data)
    weights = read_trained(unet_weights[1])
    for input_size, shapes in (
        ([48, 48], [(4, 3, 48, 48), (1, 3, 64, 80)]),
        (None, [(4, 3, 64, 64), (1, 3, 80, 96)]),
    ):
        images, what = serving.export_inputs(
            parse_config(unet.Config, []), {**weights, "input_size": input_size}
        )
        assert [tuple(t.shape) for t in images] == shapes
        assert images[0].dtype == torch.uint8
        assert what == "random pixels: no --images, and --dataset at the default data/shapes"
