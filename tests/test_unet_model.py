"""recipes/unet_model.py: grad_checkpointing trains the same weights and BatchNorm statistics with
far less activation memory; dropout zeroes half the features of the two deepest levels in training
only; ResNetUNet takes any input size; load_encoder_weights reads a local torchvision checkpoint or
a torchvision weight name, and fails with one line that names the fix."""

import copy
import sys
import urllib.error
from pathlib import Path
from urllib.parse import urlparse

import pytest
import torch
import torch.nn.functional as F
import torchvision
from conftest import FAST, ONE_THREAD, REPO, assert_ok, launch, predict_here
from torch import nn

from common.config import UserError
from unet_model import ResNetUNet, UNet, load_encoder_weights

RECIPE = "recipes/unet.py"
sys.path.append(str(REPO / "scripts" / "studies"))  # after everything else: shadows nothing
from activation_memory import saved_activation_bytes  # noqa: E402

MODELS = {
    "unet": lambda: UNet(3, base_channels=4),  # the fast tier's; the others are slow
    "unet-sync-bn": lambda: nn.SyncBatchNorm.convert_sync_batchnorm(UNet(3, base_channels=4)),
    "resnet-unet": lambda: ResNetUNet(3, base_channels=4, encoder="resnet18"),
}


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread: on 2 cores a second one slows these tiny models down, as in
    tests/test_export.py (set back after each test: the process runs other test files too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def batchnorms(model):
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def tiered(names):
    """The first in the fast tier, the others in the slow one."""
    return [pytest.param(n, marks=[pytest.mark.slow] if i else []) for i, n in enumerate(names)]


def plain_and_checkpointed(name):
    """MODELS[name] in training mode, and a copy of it with grad_checkpointing."""
    torch.manual_seed(0)
    plain = MODELS[name]().train()
    ckpt = copy.deepcopy(plain)
    ckpt.grad_checkpointing = True
    return plain, ckpt


@pytest.mark.parametrize("name", tiered(MODELS))
def test_grad_checkpointing_trains_the_same_weights_and_batchnorm_statistics(name):
    plain, ckpt = plain_and_checkpointed(name)
    steps = 3
    for model in (plain, ckpt):
        g = torch.Generator().manual_seed(1)  # the same batches for both
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(steps):
            x = torch.randn(2, 3, 32, 48, generator=g)
            y = torch.randint(0, 3, (2, 32, 48), generator=g)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    # A recompute that updated the statistics again would count 2 batches a step.
    counts = [bn.num_batches_tracked.item() for bn in batchnorms(ckpt)]
    assert counts == [steps] * len(counts)
    state, ckpt_state = plain.state_dict(), ckpt.state_dict()
    assert state.keys() == ckpt_state.keys()  # grad_checkpointing is no weight
    for key, tensor in state.items():
        torch.testing.assert_close(ckpt_state[key], tensor, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", tiered(MODELS))
def test_grad_checkpointing_keeps_far_less_for_backward(name):
    plain, ckpt = plain_and_checkpointed(name)
    x = torch.randn(2, 3, 64, 64)
    assert saved_activation_bytes(ckpt, x) < 0.3 * saved_activation_bytes(plain, x)
    # Without gradients, or in eval mode, the model simply runs: nothing to save.
    with torch.no_grad():
        torch.testing.assert_close(ckpt.eval()(x), plain.eval()(x))


DROPPED = {
    "unet": lambda dropout: UNet(3, base_channels=4, dropout=dropout),
    "resnet-unet": lambda dropout: ResNetUNet(
        3, base_channels=4, encoder="resnet18", dropout=dropout
    ),
}


@pytest.mark.parametrize("name", tiered(DROPPED))
def test_dropout_zeroes_half_the_two_deepest_levels_in_training_only(name):
    torch.manual_seed(0)
    plain, dropped = DROPPED[name](0.0), DROPPED[name](0.5)
    dropped.load_state_dict(plain.state_dict())  # dropout is no weight: the same keys load
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():  # evaluated, the two are the same model
        torch.testing.assert_close(dropped.eval()(x), plain.eval()(x))
    seen = []
    dropped.dropout.register_forward_hook(lambda module, inputs, out: seen.append((*inputs, out)))
    dropped.train()(x)
    # The end of the contracting path: the classic U-Net's last two levels down (base 4: 32
    # channels at 1/8 of the side, 64 at 1/16), the encoder's last two stages (resnet18: 256 at
    # 1/16, 512 at 1/32).
    shapes = [tuple(features.shape) for features, _ in seen]
    if name == "unet":
        assert shapes == [(2, 32, 8, 8), (2, 64, 4, 4)]
    else:
        assert shapes == [(2, 256, 4, 4), (2, 512, 2, 2)]
    for features, out in seen:
        alive = features != 0
        zeroed = (out == 0) & alive
        assert 0.35 < zeroed.sum() / alive.sum() < 0.65
        torch.testing.assert_close(out[alive & ~zeroed], 2 * features[alive & ~zeroed])


@pytest.mark.slow
def test_grad_checkpointing_updates_batchnorm_statistics_once_under_torch_compile():
    # A compiled checkpoint recomputes inside the compiled backward, which applies the
    # statistics' update once: common/segmentation/recompute.py passes it no context_fn (compile
    # rejects one).
    torch.manual_seed(0)
    plain = UNet(3, base_channels=4).train()
    ckpt = copy.deepcopy(plain)
    ckpt.grad_checkpointing = True
    x = torch.randn(2, 3, 32, 32)
    F.cross_entropy(torch.compile(ckpt, backend="aot_eager")(x), x.argmax(1)).backward()
    F.cross_entropy(plain(x), x.argmax(1)).backward()
    counts = [bn.num_batches_tracked.item() for bn in batchnorms(ckpt)]
    assert counts == [1] * len(counts)
    for key, tensor in plain.state_dict().items():
        torch.testing.assert_close(ckpt.state_dict()[key], tensor, msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("size", [(32, 32), (48, 80), (65, 33)])
def test_resnet_unet_logits_have_the_input_size(size):
    model = ResNetUNet(5, base_channels=4, encoder="resnet18").eval()
    with torch.no_grad():
        assert model(torch.randn(2, 3, *size)).shape == (2, 5, *size)


@pytest.mark.slow
def test_resnet_unet_takes_rgb_only():
    with pytest.raises(ValueError, match="3 \\(RGB\\) channels, not 1"):
        ResNetUNet(2, in_channels=1)


def resnet_file(path, arch="resnet18"):
    """A random torchvision `arch` state_dict in a file, as torchvision downloads it."""
    torch.manual_seed(2)
    state = getattr(torchvision.models, arch)().state_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return state


def assert_encoder_is(model, state):
    encoder = model.encoder.state_dict()
    assert encoder.keys() == {k for k in state if not k.startswith("fc.")}
    for key, tensor in encoder.items():
        assert torch.equal(tensor, state[key]), key


def test_load_encoder_weights_from_a_file(tmp_path):
    state = resnet_file(tmp_path / "resnet18.pth")
    assert "fc.weight" in state  # in the file, not in the encoder
    model = ResNetUNet(2, base_channels=4, encoder="resnet18")
    decoder = copy.deepcopy(model.decoder.state_dict())
    load_encoder_weights(model, tmp_path / "resnet18.pth")
    assert_encoder_is(model, state)
    assert all(torch.equal(t, decoder[k]) for k, t in model.decoder.state_dict().items())


@pytest.mark.parametrize("name", tiered(["IMAGENET1K_V1", "DEFAULT"]))
def test_load_encoder_weights_by_name_reads_torch_homes_cache(tmp_path, monkeypatch, name):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def no_download(url, *args, **kwargs):
        raise AssertionError(f"downloads {url}, which is in the cache")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_download)
    url = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.url
    cached = tmp_path / "hub" / "checkpoints" / Path(urlparse(url).path).name
    state = resnet_file(cached)
    # Files written before BatchNorm counted its batches have no num_batches_tracked.
    state = {k: v for k, v in state.items() if not k.endswith("num_batches_tracked")}
    torch.save(state, cached)
    model = ResNetUNet(2, base_channels=4, encoder="resnet18")
    load_encoder_weights(model, name)
    assert_encoder_is(model, {**model.encoder.state_dict(), **state})


def offline(monkeypatch, tmp_path):
    """An empty TORCH_HOME, and torch.hub's downloads failing as they do without a network."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))

    def no_network(url, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, expected",
    [
        ("missing", ["missing.pth does not exist", "IMAGENET1K_V1, DEFAULT"]),
        ("folder", ["weights is a folder: pass the path of a resnet18 checkpoint file"]),
        ("not-a-checkpoint", ["notes.txt is not a checkpoint", "pass a resnet18 state_dict"]),
        (
            "training-checkpoint",
            ["ckpt.pth holds a dict with keys model, epoch, not a state_dict of tensors"],
        ),
        (
            "resnet34",
            [
                "resnet34.pth does not fit resnet18 (resnet18 lacks 96 of the file's tensors, "
                "such as layer1.2.conv1.weight): pass the checkpoint of resnet18, or build the "
                "model with encoder resnet34, which it fits"
            ],
        ),
        ("unknown-name", ["IMAGENET1K_V7 is neither a file nor", "one of IMAGENET1K_V1, DEFAULT"]),
        (
            "no-network",
            [
                "cannot download resnet18 weights IMAGENET1K_V1 from https://download.pytorch.org/",
                "name resolution",
                "download that file on a machine with internet and pass its path",
            ],
        ),
    ],
)
def test_load_encoder_weights_fails_with_one_line(tmp_path, monkeypatch, case, expected):
    offline(monkeypatch, tmp_path)
    source = {
        "missing": tmp_path / "missing.pth",
        "folder": tmp_path / "weights",
        "training-checkpoint": tmp_path / "ckpt.pth",
        "not-a-checkpoint": tmp_path / "notes.txt",
        "resnet34": tmp_path / "resnet34.pth",
        "unknown-name": "IMAGENET1K_V7",
        "no-network": "IMAGENET1K_V1",
    }[case]
    if case == "not-a-checkpoint":
        source.write_text("not a checkpoint\n")
    if case == "folder":
        source.mkdir()
    if case == "training-checkpoint":
        torch.save({"model": torchvision.models.resnet18().state_dict(), "epoch": 3}, source)
    if case == "resnet34":
        resnet_file(source, "resnet34")
    model = ResNetUNet(2, base_channels=4, encoder="resnet18")
    with pytest.raises(UserError) as e:
        load_encoder_weights(model, source)
    message = str(e.value)
    assert "\n" not in message
    for part in expected:
        assert part in message


@pytest.mark.slow
def test_a_pretrained_encoder_trains_and_predict_rebuilds_it(unet, shapes, tmp_path):
    from unet import read_trained

    state = resnet_file(tmp_path / "resnet18.pth")
    out = tmp_path / "out"
    args = ["--encoder", "resnet18", "--encoder_weights", tmp_path / "resnet18.pth"]
    res = launch(
        [RECIPE, "--dataset", shapes, "--output_dir", out, *args, "--smoke", *FAST],
        launcher="python",
        env=ONE_THREAD,
    )
    assert_ok(res)
    assert "; RGB images; ResNetUNet; " in res.output, res
    record = read_trained(out / "model.safetensors")
    assert record["model"]["encoder"] == "resnet18"
    # The run started from the file's encoder (one smoke step moves it, but not far).
    from safetensors.torch import load_file

    trained = load_file(out / "model.safetensors")
    first = trained["encoder.conv1.weight"]
    assert (first - state["conv1.weight"]).abs().max() < 0.05
    # Predict needs only the weights file: it rebuilds the encoder and normalises as training.
    predict_here(
        unet, out / "model.safetensors", shapes / "imgs" / "shape_000[0-3].png", tmp_path / "masks"
    )
    assert len(list((tmp_path / "masks").glob("*_mask.png"))) == 4
