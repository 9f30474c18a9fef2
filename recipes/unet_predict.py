"""The U-Net recipe's predict and export inputs: new images as model inputs, and the masks
written back, in the training masks' values, at each image's own size.

    files = predict_files(cfg.predict)
    for paths, images, x in predict_batches(files, record, batch_size, accelerator, multiple=16):
        write_masks(paths, images, logits, record, out, overlay=False)
    images, what = sample_images(cfg, record)   # inputs that check an export
"""

import glob
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from common.data import DataError, pad_to
from common.inference import predicted_classes
from common.segmentation_data import MODES, decode_pair, padded
from common.tracking import paint
from unet_data import IMAGE_SUFFIXES, SHAPES, Pairs, list_pairs

EXPORT_SIZE = 64  # export's random inputs for a model trained at its images' own sizes


def predict_files(pattern):
    """The image files that the --predict glob matches, sorted, each header read: a bad file
    stops every process alike, as each reads them all."""
    files = sorted(p for p in glob.glob(pattern) if Path(p).suffix.lower() in IMAGE_SUFFIXES)
    if not files or len({Path(p).stem for p in files}) < len(files):
        problem = "two images of one name" if files else "no image files"
        raise DataError(f"--predict {pattern!r} matches {problem}")
    for path in files:
        try:
            Image.open(path).close()
        except OSError as e:
            raise DataError(f"cannot read image {path}: {e}") from None
    return files


def predict_batches(files, record, batch_size, accelerator, *, multiple):
    """(paths, PIL images, uint8 batch [N, C, H, W] on the device) of this process's share of
    the image `files`. The model sees them as in training: in its channels, resized to the
    record's input_size, or at their own size (bucket_by_size), padded to `multiple` as a
    training batch is, one at a time."""
    from torchvision.transforms.v2.functional import pil_to_tensor, resize  # see decode_pair

    native = record["input_size"] is None
    batch_size = 1 if native else batch_size
    with accelerator.split_between_processes(files) as mine:
        for start in range(0, len(mine), batch_size):
            paths = mine[start : start + batch_size]
            images = [Image.open(p).convert(MODES[record["model"]["in_channels"]]) for p in paths]
            if native:
                height, width = (
                    padded(images[0].height, multiple),
                    padded(images[0].width, multiple),
                )
                x = pad_to(pil_to_tensor(images[0]), height, width, 0)[None]
            else:
                size = record["input_size"]
                x = torch.stack([resize(pil_to_tensor(im), size, antialias=True) for im in images])
            yield paths, images, x.to(accelerator.device)


def write_masks(paths, images, logits, record, out, *, overlay):
    """NAME_mask.png for each image, at its own size, in the training masks' values; with
    `overlay`, NAME_overlay.png too: the image with the classes painted on."""
    values, num_classes = record["mask_values"], record["model"]["num_classes"]
    lut = np.array(values, np.uint8 if max(values) < 256 else np.uint16)  # class -> mask value
    for path, image, lg in zip(paths, images, logits):
        if record["input_size"] is None:  # padded: cut the padding off
            lg = lg[:, : image.height, : image.width].float()
        else:
            lg = F.interpolate(lg[None].float(), (image.height, image.width), mode="bilinear")[0]
        classes = predicted_classes(lg[None], num_classes)[0].cpu()
        Image.fromarray(lut[classes.numpy()]).save(out / f"{Path(path).stem}_mask.png")
        if overlay:
            rgb = torch.from_numpy(np.asarray(image.convert("RGB"), np.float32))
            rgb = torch.where(classes[..., None] > 0, 0.5 * rgb + 0.5 * paint(classes), rgb)
            overlay_image = Image.fromarray(rgb.numpy().astype(np.uint8))
            overlay_image.save(out / f"{Path(path).stem}_overlay.png")


def sample_images(cfg, record, *, multiple, count=4):
    """([images, image], what they are): inputs to check an export on. Up to `count` validation
    images as the data gives them (uint8 [N, C, H, W]), at the size the model was trained on
    (input_size, or the first one's own size padded), and the first one again at another size
    (16 and 32 pixels more). With no data (the default dataset, not made), random pixels of that
    size, or EXPORT_SIZE for a model trained at its images' own sizes: its weights came from
    data that need not be here."""
    from torchvision.transforms.v2.functional import resize  # see decode_pair

    in_channels = record["model"]["in_channels"]
    if cfg.dataset == SHAPES and not Path(SHAPES).exists():
        h, w = record["input_size"] or (EXPORT_SIZE, EXPORT_SIZE)
        shape = (count, in_channels, h + 16, w + 32)
        seeded = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=seeded)
        return [x[..., :h, :w], x[:1]], f"random pixels: no --dataset, {SHAPES} is not made"
    val_pairs = Pairs(list_pairs(cfg)[1])
    mode, values = MODES[in_channels], record["mask_values"]
    images = [decode_pair(val_pairs, i, values, mode)[0] for i in range(min(count, len(val_pairs)))]
    first = images[0]
    h, w = record["input_size"] or (
        padded(first.shape[1], multiple),
        padded(first.shape[2], multiple),
    )
    return [
        torch.stack([resize(im, [h, w], antialias=True) for im in images]),
        resize(images[0], [h + 16, w + 32], antialias=True)[None],
    ], f"images of {cfg.dataset}"
