"""The U-Net recipe's model outside training: the settings stored in a weights file, the logits
of whole images, of tiles and of flips (segment), the masks predict writes for new images, and
the sample inputs that check an export.

    stored = SegmentationWeights(settings, values, input_size, flips).metadata(recipe=NAME)
    weights = SegmentationWeights.read("runs/unet/model.safetensors")  # or None
    model, weights = load_model(cfg, build_model)                       # for predict and export
    predict(cfg, accelerator, build_model, prepare)                     # NAME_mask.png files
"""

import dataclasses
import glob
import itertools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors import SafetensorError, safe_open
from unet_data import (
    IMAGE_SUFFIXES,
    MODES,
    SHAPES,
    SegmentationConfig,
    decode_pair,
    open_sources,
    padded,
)
from unet_model import MIN_SIZE, PAD_MULTIPLE

from common.checkpoint import load_weights
from common.config import UserError, require
from common.data import DataError, pad_to
from common.export import OnnxModel, onnx_metadata

EXPORT_SIZE = 64  # export's random inputs for a model trained at its images' own sizes


@dataclass
class PredictConfig(SegmentationConfig):
    """SegmentationConfig and the settings of predict, of its tiles and its flips."""

    # Predict: write masks for new images with `weights`, whose file holds the model settings.
    predict: str | None = None  # an image file or glob
    predict_dir: str | None = None  # where the NAME_mask.png go; default output_dir/predictions
    overlay: bool = False  # also write NAME_overlay.png, the image with the classes painted on
    # Predict and eval_only (and the evaluation of a training run): see segment().
    predict_tile: int = 0  # run the model on overlapping tiles of this size, blended; 0: whole
    predict_flip: bool = False  # average the logits of the image and its flips seen in training

    def validate(self):
        super().validate()
        require(
            not self.predict or self.weights,
            "predict needs weights: add --weights PATH/model.safetensors",
        )
        tile = self.predict_tile
        require(
            tile == 0 or (tile >= MIN_SIZE and tile % PAD_MULTIPLE == 0),
            f"predict_tile must be 0 or a multiple of {PAD_MULTIPLE} from {MIN_SIZE} up (the "
            f"U-Net halves a tile 4 times), got {tile}",
        )
        require(not (self.predict and self.eval_only), "choose one of predict and eval_only")
        require(not (self.predict and self.export), "choose one of predict and export")
        require(
            self.predict or not str(self.weights).endswith(".onnx"),
            "an .onnx file only predicts: train or evaluate from the .safetensors it was made from",
        )


def predicted_classes(logits, num_classes):
    """Hard predictions [N, H, W]: argmax, or logit > 0 (sigmoid > 0.5) for one class."""
    return (logits[:, 0] > 0).long() if num_classes == 1 else logits.argmax(1)


# Class 0 (and padding) black, then a colour per class, repeating after six.
COLOURS = torch.tensor(
    [
        (0, 0, 0),
        (230, 25, 75),
        (60, 180, 75),
        (0, 130, 200),
        (255, 225, 25),
        (145, 30, 180),
        (70, 240, 240),
    ],
    dtype=torch.uint8,
)


def paint(classes):
    """Class indices [..., H, W] -> uint8 colours [..., H, W, 3]."""
    classes = classes.clamp(min=0)
    index = torch.where(classes > 0, (classes - 1) % (len(COLOURS) - 1) + 1, 0)
    return COLOURS.to(classes.device)[index]


def image_panel(x, logits, target, num_classes, count=4):
    """image | prediction | truth of the first `count` images, side by side: floats
    [N, 3, H, 3W]. x: uint8 images of any channels, shown as RGB (grey for 1 or 2, without
    alpha for 4)."""
    pred = predicted_classes(logits[:count], num_classes)
    painted = [paint(c).permute(0, 3, 1, 2) for c in (pred, target[:count])]
    rgb = x[:count, :3] if x.shape[1] >= 3 else x[:count, [0, 0, 0]]
    return torch.cat([rgb, *painted], dim=3).float() / 255


@dataclass
class SegmentationWeights:
    """What predict needs besides the tensors, stored in the weights file's metadata as one JSON
    entry, so it reads back typed: the model's settings, the classes and the training size."""

    model: dict  # the Config fields that build the model, e.g. {"num_classes": 4, ...}
    mask_values: list  # class i is mask value mask_values[i]
    input_size: list | None  # [height, width] that the model saw; None: each image its own
    # The flips of its training augmentation, which predict_flip averages over: "h" (horizontal),
    # "v" (vertical), both or "". Files written before it was stored: "h", the recipe's default.
    flips: str = "h"

    KEY = "segmentation"

    @property
    def in_channels(self):
        """The model's input channels: files written before they were stored took RGB."""
        return self.model.get("in_channels", 3)

    def metadata(self, **more):
        """The safetensors metadata for save_weights(), with `more` entries beside it."""
        return {self.KEY: json.dumps(dataclasses.asdict(self)), **more}

    @classmethod
    def read(cls, path):
        """The settings stored in a weights file or an exported .onnx file; None if it holds
        none (or is neither)."""
        if Path(path).suffix not in (".safetensors", ".onnx") or not Path(path).is_file():
            return None  # load_weights reports a missing file
        if Path(path).suffix == ".onnx":
            meta = onnx_metadata(path)  # export_onnx copied the weights file's metadata
        else:
            try:
                with safe_open(path, "pt") as f:
                    meta = f.metadata() or {}
            except SafetensorError as e:
                raise UserError(
                    f"cannot read weights file {path} ({e}): it is truncated or not a weights file"
                ) from None
        if cls.KEY in meta:
            return cls(**json.loads(meta[cls.KEY]))
        if "mask_values" in meta:  # the settings as strings, one key each, as saved until 2026
            raise UserError(
                f"{path} stores its settings one key each, an old format that this "
                f"recipe no longer reads: train the model again to save it anew"
            )
        return None


def fit_to_weights(cfg, weights, names):
    """cfg with the model settings `names` that `weights` was trained with: num_classes and
    in_channels 0 (from the data) take the stored value; a setting that differs stops with a
    line naming it."""
    if weights is None:
        return cfg
    settings = {"in_channels": weights.in_channels, **weights.model}
    for name in names:
        stored, given = settings.get(name), getattr(cfg, name)
        if name in ("num_classes", "in_channels") and given == 0:
            cfg = dataclasses.replace(cfg, **{name: stored})
        elif stored is not None and stored != given:
            raise UserError(
                f"{cfg.weights} was trained with {name} {stored}, not {given}: add "
                f"--{name} {stored}"
            )
    return cfg


def tile_starts(size, tile):
    """Where the tiles along an image side of `size` pixels start: every `stride` pixels, a
    multiple of 16 so that each tile meets the U-Net's pooling grid where the whole image would,
    overlapping by a quarter of a tile or more; the last tile ends at the edge."""
    stride = max(PAD_MULTIPLE, (tile - tile // 4) // PAD_MULTIPLE * PAD_MULTIPLE)
    return [*range(0, size - tile, stride), size - tile]


def gaussian_weights(height, width, device):
    """[height, width] weights for blending tiles, highest at the centre (sigma 1/8 of the side,
    as nnU-Net): the logits near a tile's edge, which saw the zero padding past it, count least."""

    def side(n):
        offsets = torch.arange(n, dtype=torch.float32, device=device) - (n - 1) / 2
        return torch.exp(-0.5 * (offsets / (n / 8)) ** 2)  # 3e-4 at the edge, never 0

    return side(height)[:, None] * side(width)[None]


def tiled(net, x, tile):
    """net(x) for images x [N, C, H, W], or, where they are larger than tile x tile, the logits
    of overlapping tiles blended with Gaussian weights. The network sees one tile at a time, so
    its memory grows with the tile; only the logits (fp32) grow with the image."""
    height, width = x.shape[-2:]
    if not tile or (height <= tile and width <= tile):
        return net(x)
    tile_h, tile_w = min(tile, height), min(tile, width)
    weights = gaussian_weights(tile_h, tile_w, x.device)
    logits = total = None
    for top, left in itertools.product(tile_starts(height, tile_h), tile_starts(width, tile_w)):
        window = (..., slice(top, top + tile_h), slice(left, left + tile_w))
        part = net(x[window]).float()
        if logits is None:
            logits = part.new_zeros((*part.shape[:2], height, width))
            total = part.new_zeros((height, width))
        logits[window] += part * weights
        total[window] += weights
    return logits.div_(total)


def segment(net, x, cfg, flips):
    """The logits of images x [N, C, H, W] as predict and evaluation compute them: net(x), or
    with cfg.predict_tile, from tiles (tiled()), and with cfg.predict_flip, the mean over the
    image and its flips along the axes the model was trained to flip (`flips`: "h", "v", both).
    The mean of the logits, not of the probabilities: it stays logits, for the loss, the argmax
    and the tiles' blend, and one class (sigmoid) and several (softmax) are averaged alike."""
    if not cfg.predict_flip:
        return tiled(net, x, cfg.predict_tile)
    if not flips:
        raise UserError(
            "predict_flip averages over the flips of training, and this model was "
            "trained with none (hflip and vflip 0): leave predict_flip off"
        )
    axes = [dim for axis, dim in (("v", 2), ("h", 3)) if axis in flips]
    views = [dims for n in range(len(axes) + 1) for dims in itertools.combinations(axes, n)]
    logits = sum(tiled(net, x.flip(dims), cfg.predict_tile).float().flip(dims) for dims in views)
    return logits / len(views)


def load_model(cfg, build_model, device="cpu"):
    """(model, SegmentationWeights) of the --weights file, for predict and export: the model that
    build_model(settings) makes from the settings stored in the file, with its weights, in eval
    mode on `device`; or for an .onnx file, an onnxruntime session that is called alike."""
    weights = SegmentationWeights.read(cfg.weights)
    if weights is None:
        raise UserError(
            f"{cfg.weights} holds no segmentation settings: predict and export need "
            f"weights saved by this recipe"
        )
    if Path(cfg.weights).suffix == ".onnx":
        return OnnxModel(cfg.weights), weights
    model = build_model(weights.model)
    load_weights(model, cfg.weights)
    return model.to(device).eval(), weights


def sample_images(cfg, weights, count=4):
    """([images, image], what they are): inputs to check an export on. Up to `count` validation
    images as the data gives them (uint8 [N, C, H, W]), at the size the model was trained on
    (input_size, or the first one's own size padded), and the first one again at another size
    (16 and 32 pixels more). With no data (the default dataset, not made), random pixels of that
    size, or EXPORT_SIZE for a model trained at its images' own sizes: its weights came from
    data that need not be here."""
    from torchvision.transforms.v2.functional import resize  # see decode_pair

    if cfg.dataset == SHAPES and not Path(SHAPES).exists():
        h, w = weights.input_size or (EXPORT_SIZE, EXPORT_SIZE)
        shape = (count, weights.in_channels, h + 16, w + 32)
        seeded = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=seeded)
        return [x[..., :h, :w], x[:1]], f"random pixels: no --dataset, {SHAPES} is not made"
    _, val_source = open_sources(cfg)
    mode = MODES[weights.in_channels]
    images = [
        decode_pair(val_source, i, weights.mask_values, mode)[0]
        for i in range(min(count, len(val_source)))
    ]
    h, w = weights.input_size or (padded(images[0].shape[1]), padded(images[0].shape[2]))
    return [
        torch.stack([resize(im, [h, w], antialias=True) for im in images]),
        resize(images[0], [h + 16, w + 32], antialias=True)[None],
    ], f"images of {cfg.dataset}"


def predict(cfg, accelerator, build_model, prepare_input):
    """A mask PNG per image of the --predict glob, at the image's size, in the training masks'
    values; --overlay also paints the classes on the image. Each process does a share.
    build_model(settings) rebuilds the model from the settings stored in the weights file;
    prepare_input(x) makes the model's input of uint8 images [N, C, H, W] in its channels."""
    from torchvision.transforms.v2.functional import pil_to_tensor, resize  # see decode_pair

    model, weights = load_model(cfg, build_model, accelerator.device)
    num_classes = weights.model["num_classes"]
    files = sorted(p for p in glob.glob(cfg.predict) if Path(p).suffix.lower() in IMAGE_SUFFIXES)
    if not files or len({Path(p).stem for p in files}) < len(files):
        raise DataError(
            f"--predict {cfg.predict!r} matches "
            f"{'two images of one name' if files else 'no image files'}"
        )
    for path in files:  # every process opens every header, so a bad file stops them all alike
        try:
            Image.open(path).close()
        except OSError as e:
            raise DataError(f"cannot read image {path}: {e}") from None
    out = Path(cfg.predict_dir or Path(cfg.output_dir) / "predictions")
    out.mkdir(parents=True, exist_ok=True)
    values = weights.mask_values
    lut = np.array(values, np.uint8 if max(values) < 256 else np.uint16)  # class -> mask value
    # The model sees images as in training: in its channels, resized to input_size, or at their
    # own size (bucket_by_size), padded like a training batch, one at a time. predict_tile
    # applies at that scale: it lets a model trained at its images' own size take large ones.
    native = weights.input_size is None
    batch_size = 1 if native else cfg.eval_batch_size
    with accelerator.split_between_processes(files) as mine:
        for start in range(0, len(mine), batch_size):
            paths = mine[start : start + batch_size]
            images = [Image.open(p).convert(MODES[weights.in_channels]) for p in paths]
            if native:
                height, width = padded(images[0].height), padded(images[0].width)
                x = pad_to(pil_to_tensor(images[0]), height, width, 0)[None]
            else:
                x = torch.stack(
                    [resize(pil_to_tensor(im), weights.input_size, antialias=True) for im in images]
                )
            with torch.inference_mode(), accelerator.autocast():
                logits = segment(model, prepare_input(x.to(accelerator.device)), cfg, weights.flips)
            for path, image, lg in zip(paths, images, logits):
                if native:
                    lg = lg[:, : image.height, : image.width].float()
                else:
                    size = (image.height, image.width)
                    lg = F.interpolate(lg[None].float(), size, mode="bilinear")[0]
                classes = predicted_classes(lg[None], num_classes)[0].cpu()
                Image.fromarray(lut[classes.numpy()]).save(out / f"{Path(path).stem}_mask.png")
                if cfg.overlay:
                    rgb = torch.from_numpy(np.asarray(image.convert("RGB"), np.float32))
                    rgb = torch.where(classes[..., None] > 0, 0.5 * rgb + 0.5 * paint(classes), rgb)
                    overlay = Image.fromarray(rgb.numpy().astype(np.uint8))
                    overlay.save(out / f"{Path(path).stem}_overlay.png")
    accelerator.wait_for_everyone()
    accelerator.print(f"wrote {len(files)} masks (values {','.join(map(str, values))}) to {out}/")
