"""The U-Net recipe's model, the part a copy with its own model replaces (recipes/unet.py takes
what is here by name, and nothing else of it):

    ModelConfig                 the model's settings, which the recipe's Config takes in (a
                                model of your own keeps in_channels and channels_last)
    MODEL_SETTINGS              those that rebuild it, recorded in every weights file
    build_model(settings, cfg)  the model those settings describe, as training builds it
    prepare_input(x, cfg)       a uint8 batch as the model takes it (normalised for an encoder)
    input_channels(cfg)         the channels the data is read in (0: the images' own)
    PAD_MULTIPLE, MIN_SIZE      the sizes the model takes

Two U-Nets:
UNet: the classic U-Net of Ronneberger et al., as in milesial/Pytorch-UNet: 4 levels down, 4 up,
a skip connection at each level, trained from scratch.

ResNetUNet: the U-Net of segmentation_models.pytorch: a torchvision ResNet encoder, which
load_encoder_weights can start from ImageNet weights, and a decoder of 5 blocks.

Both take grad_checkpointing: each level keeps only its input for backward and runs again there
(common/segmentation/recompute.py), for less activation memory at the cost of one more
forward. It changes no weight, so weights files do not record it.

Both take dropout: in training, a share of the features of the two deepest levels (the end of the
contracting path, where the U-Net paper puts its "drop-out layers", as zhixuhao/unet's drop4 and
drop5) is zeroed at random and the rest scaled up, as nn.Dropout does: on their way down and
along their skips. It has no weights, so weights files do not record it either.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from common.config import UserError, require
from common.segmentation.recompute import recompute

# The U-Net halves an image 4 times on its way down: an input side that is a multiple of 2**4
# comes back up at its own size, so padded batches and predict's tiles keep to this grid.
PAD_MULTIPLE = 16
MIN_SIZE = 32  # the smallest input side that training, crops and tiles accept

ENCODERS = ("resnet18", "resnet34", "resnet50")  # torchvision models that ResNetUNet takes
# The normalisation that torchvision's ImageNet weights were trained with, per RGB channel:
# inputs (0..1) become (x - mean) / std before a pretrained encoder sees them.
ENCODER_MEAN = (0.485, 0.456, 0.406)
ENCODER_STD = (0.229, 0.224, 0.225)
ENCODER_MULTIPLE = 32  # the encoder halves an image 5 times: ResNetUNet pads to this internally


@dataclass
class ModelConfig:
    # Model. ADAPT: your model's settings (the recipe's Config takes them in: --help lists them).
    in_channels: int = 0  # of the model's input: 1 grey, 3 RGB, 4 RGBA; 0: the images' own
    encoder: str = ""  # resnet18, resnet34 or resnet50: a torchvision ResNet encoder; "": none
    encoder_weights: str = ""  # pretrained encoder: a torchvision .pth file, or a name to download
    base_channels: int = 64  # first level's width, doubled at each level down; 16 with encoder
    bilinear: bool = False  # upsample by bilinear interpolation, not transposed convolutions
    channels_last: bool | None = None  # NHWC: faster fp16/bf16 convolutions; auto: on with CUDA
    grad_checkpointing: bool = False  # recompute each level's activations in backward: less memory
    dropout: float = 0.0  # in training, in the two deepest levels (the U-Net paper's 0.5); 0: none

    def validate(self):
        """The one-line errors of the model's settings, at start-up; then the next class's."""
        super().validate()
        require(
            self.base_channels >= 1, f"base_channels must be at least 1, got {self.base_channels}"
        )
        require(
            self.in_channels in (0, 1, 2, 3, 4),
            f"in_channels must be 0 (from the images), 1, 2, 3 or 4, got {self.in_channels}",
        )
        require(
            self.encoder in ("", *ENCODERS),
            f"encoder must be empty (the classic U-Net) or {', '.join(ENCODERS)}, got "
            f"{self.encoder!r}",
        )
        require(
            not self.encoder or self.in_channels in (0, 3),
            f"a {self.encoder} encoder takes RGB: leave in_channels at 0 (images are read as RGB)",
        )
        require(not self.encoder or not self.bilinear, "an encoder's decoder always interpolates")
        require(
            0 <= self.dropout < 1,
            f"dropout must be 0 (none) to below 1, such as 0.5, got {self.dropout}",
        )
        require(
            not self.encoder_weights or self.encoder,
            "encoder_weights needs an encoder: add --encoder resnet34 (or resnet18, resnet50)",
        )


# The settings that rebuild the model, recorded in the weights file for predict and export.
MODEL_SETTINGS = ("in_channels", "num_classes", "encoder", "base_channels", "bilinear")


def input_channels(cfg):
    """The channels the images are read in: 3 (RGB) for an encoder, else in_channels (0: each
    image's own mode decides, the same for all)."""
    return 3 if cfg.encoder else cfg.in_channels


def build_model(settings, cfg=None):
    """The model that `settings` (MODEL_SETTINGS) describe, as predict and export rebuild it; with
    the run's settings `cfg`, as training builds it: its activations recomputed in the backward
    pass (grad_checkpointing, which changes no weight), dropout in its two deepest levels, its
    encoder started from encoder_weights (unless --weights give the whole model), in channels_last
    memory format if set."""
    if cfg is None:
        return build_unet(**settings)
    model = build_unet(**settings, grad_checkpointing=cfg.grad_checkpointing, dropout=cfg.dropout)
    if cfg.encoder_weights and not cfg.weights:  # a pretrained encoder, under a new decoder
        load_encoder_weights(model, cfg.encoder_weights)
    return model.to(memory_format=torch.channels_last) if cfg.channels_last else model


# ADAPT: your input: a uint8 batch [N, C, H, W] as floats (training, predict and export); with a
# pretrained encoder, normalised as its ImageNet weights expect.
def prepare_input(x, cfg):
    x = x.float() / 255
    if cfg.encoder:
        mean, std = (
            torch.tensor(v, device=x.device).view(1, -1, 1, 1) for v in (ENCODER_MEAN, ENCODER_STD)
        )
        x = (x - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x


def _call(module, *inputs):
    return module(*inputs)


def double_conv(cin, cout, mid=None):
    mid = mid or cout
    return nn.Sequential(
        nn.Conv2d(cin, mid, 3, padding=1, bias=False),
        nn.BatchNorm2d(mid),
        nn.ReLU(inplace=True),
        nn.Conv2d(mid, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class Up(nn.Module):
    def __init__(self, cin, cout, bilinear):
        super().__init__()
        if bilinear:  # no weights in the upsampling: the convolutions halve the channels instead
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = double_conv(cin, cout, cin // 2)
        else:
            self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
            self.conv = double_conv(cin, cout)

    def forward(self, x, skip):
        x = self.up(x)
        # An odd size lost a pixel going down: pad back to the skip's size.
        dy, dx = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], 1))


class UNet(nn.Module):
    def __init__(
        self,
        num_classes,
        base_channels=64,
        bilinear=False,
        in_channels=3,
        grad_checkpointing=False,
        dropout=0.0,
    ):
        super().__init__()
        self.grad_checkpointing = grad_checkpointing  # a plain attribute: not in the state_dict
        self.dropout = nn.Dropout(dropout)  # of the two deepest levels, in training; no weights
        c = [base_channels * 2**i for i in range(5)]  # 64, 128, 256, 512, 1024
        f = 2 if bilinear else 1
        self.inc = double_conv(in_channels, c[0])
        self.downs = nn.ModuleList(
            nn.Sequential(nn.MaxPool2d(2), double_conv(c[i], c[i + 1] // (f if i == 3 else 1)))
            for i in range(4)
        )
        self.ups = nn.ModuleList(
            Up(c[i], c[i - 1] // (f if i > 1 else 1), bilinear) for i in (4, 3, 2, 1)
        )
        self.outc = nn.Conv2d(c[0], num_classes, 1)

    def forward(self, x):
        level = recompute if self.grad_checkpointing else _call  # recompute: while training
        skips = [level(self.inc, x)]
        for i, down in enumerate(self.downs):
            features = level(down, skips[-1])
            # The end of the contracting path: the two deepest levels, at 1/8 and 1/16.
            skips.append(self.dropout(features) if i >= 2 else features)
        x = skips.pop()
        for up in self.ups:
            x = level(up, x, skips.pop())
        return self.outc(x)  # logits [N, num_classes, H, W]


class ResNetEncoder(nn.Module):
    """A torchvision ResNet without its pooling and classifier, run one stage at a time. Its
    modules keep torchvision's names, so that torchvision's checkpoints load as they are."""

    def __init__(self, name):
        super().__init__()
        # Here, not at the top: torchvision loads torch's compiler (over 1 s), which --help skips.
        import torchvision

        resnet = getattr(torchvision.models, name)()
        self.conv1, self.bn1, self.relu = resnet.conv1, resnet.bn1, resnet.relu
        self.maxpool = resnet.maxpool
        self.layer1, self.layer2 = resnet.layer1, resnet.layer2
        self.layer3, self.layer4 = resnet.layer3, resnet.layer4
        wide = type(resnet.layer1[0]).expansion  # 4 for resnet50's bottleneck blocks, else 1
        self.channels = [64] + [n * wide for n in (64, 128, 256, 512)]  # of stages 0..4

    def forward(self, x, stage):
        """Stage 0..4 of the encoder on x: features at strides 2, 4, 8, 16, 32 of the image."""
        if stage == 0:
            return self.relu(self.bn1(self.conv1(x)))
        if stage == 1:
            return self.layer1(self.maxpool(x))
        return getattr(self, f"layer{stage}")(x)


class DecoderBlock(nn.Module):
    """Upsample x2 (nearest, as segmentation_models.pytorch), concatenate the skip, 2 convs."""

    def __init__(self, cin, skip, cout):
        super().__init__()
        self.conv = double_conv(cin + skip, cout)

    def forward(self, x, skip=None):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        if skip is not None:
            x = torch.cat([x, skip], 1)
        return self.conv(x)


class ResNetUNet(nn.Module):
    def __init__(
        self,
        num_classes,
        base_channels=16,
        in_channels=3,
        encoder="resnet34",
        grad_checkpointing=False,
        dropout=0.0,
    ):
        super().__init__()
        if encoder not in ENCODERS:
            raise ValueError(f"encoder {encoder!r}: choose one of {', '.join(ENCODERS)}")
        if in_channels != 3:
            raise ValueError(f"the {encoder} encoder takes 3 (RGB) channels, not {in_channels}")
        self.encoder_name = encoder
        self.grad_checkpointing = grad_checkpointing  # a plain attribute: not in the state_dict
        self.dropout = nn.Dropout(dropout)  # of the encoder's two deepest stages, in training
        self.encoder = ResNetEncoder(encoder)
        e = self.encoder.channels
        d = [base_channels * 2**i for i in (4, 3, 2, 1, 0)]  # base 16: 256, 128, 64, 32, 16
        # Block i takes the block before's output (the deepest features first) and the encoder
        # features of the next stride up; the last block, at full size, has no skip.
        cins, skips = [e[4], *d[:4]], [e[3], e[2], e[1], e[0], 0]
        self.decoder = nn.ModuleList(DecoderBlock(*cs) for cs in zip(cins, skips, d))
        self.head = nn.Conv2d(d[4], num_classes, 1)

    def forward(self, x):
        level = recompute if self.grad_checkpointing else _call  # recompute: while training
        h, w = x.shape[2:]
        # Any size: pad the bottom and right to the encoder's grid, crop the logits back.
        x = F.pad(x, [0, -w % ENCODER_MULTIPLE, 0, -h % ENCODER_MULTIPLE])
        features = []
        for stage in range(5):
            x = level(self.encoder, x, stage)
            x = self.dropout(x) if stage >= 3 else x  # the two deepest stages, at 1/16 and 1/32
            features.append(x)
        skips = features[3::-1] + [None]  # strides 16, 8, 4, 2, then none at full size
        x = features[4]
        for block, skip in zip(self.decoder, skips):
            x = level(block, x, skip)
        return self.head(x)[:, :, :h, :w]  # logits [N, num_classes, H, W]


def build_unet(
    *,
    num_classes,
    in_channels,
    encoder,
    base_channels,
    bilinear,
    grad_checkpointing=False,
    dropout=0.0,
):
    """The classic UNet, or with `encoder` (one of ENCODERS) a ResNetUNet, whose decoder always
    interpolates (bilinear is for the classic one)."""
    if encoder:
        return ResNetUNet(
            num_classes,
            base_channels=base_channels,
            in_channels=in_channels,
            encoder=encoder,
            grad_checkpointing=grad_checkpointing,
            dropout=dropout,
        )
    return UNet(
        num_classes,
        base_channels=base_channels,
        bilinear=bilinear,
        in_channels=in_channels,
        grad_checkpointing=grad_checkpointing,
        dropout=dropout,
    )


def load_encoder_weights(model, source):
    """Set a ResNetUNet's encoder to torchvision weights: source is the path of a checkpoint file
    as torchvision downloads it (the state_dict of torchvision.models.resnet34(), say), or the
    name of torchvision weights such as "IMAGENET1K_V1" or "DEFAULT", downloaded into
    $TORCH_HOME/hub/checkpoints or read from there. The classifier (fc.*) is not used. A
    UserError names what fails and the fix."""
    import torchvision  # here, not at the top: see ResNetEncoder

    arch = model.encoder_name
    weights = torchvision.models.get_model_weights(arch)  # an Enum of the published weights
    names = list(weights.__members__)  # "DEFAULT" included
    source = str(source)
    if Path(source).exists() or "/" in source or "." in source:  # weight names have neither
        state, what = _read_checkpoint(Path(source), arch, names), source
    else:
        state, what = _torchvision_weights(weights, source, arch), f"torchvision's {source}"
    state = {k: v for k, v in state.items() if not k.startswith("fc.")}
    problem = _misfit(state, arch)
    if problem:
        others = [a for a in ENCODERS if a != arch and not _misfit(state, a)]
        other = f", or build the model with encoder {others[0]}, which it fits" if others else ""
        raise UserError(
            f"{what} does not fit {arch} ({problem}): pass the checkpoint of {arch}{other}"
        )
    model.encoder.load_state_dict(state)


def _read_checkpoint(path, arch, names):
    if not path.is_file():
        kind = "is a folder" if path.is_dir() else "does not exist"
        raise UserError(
            f"{path} {kind}: pass the path of a {arch} checkpoint file, or the name of "
            f"torchvision weights ({', '.join(names)})"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises many types: any of them means the same here
        raise UserError(
            f"{path} is not a checkpoint that torch.load(weights_only=True) reads "
            f"({type(e).__name__}): pass a {arch} state_dict written by torch.save"
        ) from e
    if not (isinstance(state, dict) and all(isinstance(v, torch.Tensor) for v in state.values())):
        holds = f"a dict with keys {', '.join(map(str, list(state)[:4]))}"
        holds = holds if isinstance(state, dict) else f"a {type(state).__name__}"
        raise UserError(
            f"{path} holds {holds}, not a state_dict of tensors: pass the file that "
            f"torch.save(model.state_dict(), path) writes for a torchvision {arch}"
        )
    return state


def _torchvision_weights(enum, name, arch):
    if name not in enum.__members__:
        raise UserError(
            f"{name} is neither a file nor a torchvision weight name of {arch}: pass the path "
            f"of a checkpoint file or one of {', '.join(enum.__members__)}"
        )
    weights = enum[name]
    try:
        # Downloads into $TORCH_HOME/hub/checkpoints, or reads the file already there.
        return weights.get_state_dict(progress=False, map_location="cpu", weights_only=True)
    except OSError as e:  # no network (URLError is one), or a cache folder that is not writable
        reason = " ".join(str(getattr(e, "reason", e)).split())  # on one line
        raise UserError(
            f"cannot download {arch} weights {name} from {weights.url} ({reason}): download "
            f"that file on a machine with internet and pass its path"
        ) from e


def _misfit(state, arch):
    """Why a state_dict (without fc.*) is not the encoder `arch`'s; None when it is."""
    import torchvision

    with torch.device("meta"):  # the tensors' names and shapes, without allocating them
        encoder = getattr(torchvision.models, arch)().state_dict()
    shapes = {k: tuple(v.shape) for k, v in encoder.items() if not k.startswith("fc.")}
    for name, shape in shapes.items():
        if name in state and tuple(state[name].shape) != shape:
            file_shape = list(state[name].shape)
            return f"{name} is {file_shape} in the file, {list(shape)} in {arch}"
    # Files written before BatchNorm counted its batches lack num_batches_tracked: BatchNorm's
    # loading keeps the layer's own count then.
    missing = [k for k in shapes if k not in state and not k.endswith("num_batches_tracked")]
    if missing:
        return f"the file lacks {len(missing)} of {arch}'s tensors, such as {missing[0]}"
    extra = [k for k in state if k not in shapes]
    if extra:
        return f"{arch} lacks {len(extra)} of the file's tensors, such as {extra[0]}"
    return None
