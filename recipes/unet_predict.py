"""The U-Net recipe's predict and export inputs: new images as model inputs, and the masks
written back, in the training masks' values or colours, at each image's own size.

    files = predict_files(cfg.predict)
    for paths, images, x, sizes in predict_batches(files, record, batch_size=8, ...):
        write_masks(paths, images, logits, record, out, sizes=sizes, overlay=False)
    images, what = sample_images(val_pairs, record, source="data/x")  # to check an export
"""

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from common.data import IMAGE_SUFFIXES, DataError, image_files, pad_to
from common.inference import predicted_classes
from common.segmentation_data import MODES, padded
from common.tracking import overlay as painted_on

EXPORT_SIZE = 64  # export's random inputs for a model trained at its images' own sizes


def predict_files(pattern):
    """The image files that the --predict glob matches, sorted, each header read (image_files):
    a bad file stops every process alike, as each reads them all. Two of one name would write
    one mask."""
    files = image_files(pattern, IMAGE_SUFFIXES)
    if len({Path(p).stem for p in files}) < len(files):
        raise DataError(f"--predict {pattern!r} matches two images of one name")
    return files


def model_size(record, height, width):
    """The (height, width) at which the model sees an image of that size: the record's
    input_size, or the image's own size times the record's scale, or its own size."""
    if record["scale"]:
        return max(int(height * record["scale"]), 1), max(int(width * record["scale"]), 1)
    return tuple(record["input_size"] or (height, width))


def predict_batches(files, record, *, batch_size, accelerator, multiple):
    """(paths, PIL images, uint8 batch [N, C, H, W] on the device, the (height, width) of each
    image in the batch before padding) of this process's share of the image `files`. The model
    sees them as in training: in its channels, resized to the record's input_size (in batches),
    or to their own size times its scale, or at their own size (bucket_by_size, scale), padded to
    `multiple` as a training batch is, one at a time."""
    from torchvision.transforms.v2.functional import pil_to_tensor, resize  # see decode_pair

    one_size = record["input_size"] is not None and not record["scale"]
    batch_size = batch_size if one_size else 1
    with accelerator.split_between_processes(files) as mine:
        for start in range(0, len(mine), batch_size):
            paths = mine[start : start + batch_size]
            images = [Image.open(p).convert(MODES[record["model"]["in_channels"]]) for p in paths]
            sizes = [model_size(record, im.height, im.width) for im in images]
            x = [
                resize(pil_to_tensor(im), list(size), antialias=True)
                for im, size in zip(images, sizes)
            ]
            if not one_size:
                height, width = (padded(n, multiple) for n in sizes[0])
                x = [pad_to(x[0], height, width, 0)]
            yield paths, images, torch.stack(x).to(accelerator.device), sizes


def write_masks(paths, images, logits, record, out, *, sizes, overlay):
    """NAME_mask.png for each image, at its own size, in the training masks' values (or colours,
    as an RGB PNG); with `overlay`, NAME_overlay.png too: the image with the classes painted on.
    sizes: each image's (height, width) in the batch, before padding."""
    values, num_classes = record["mask_values"], record["model"]["num_classes"]
    if record["colour_masks"]:  # class -> (r, g, b)
        lut = np.array([[(v >> 16) & 255, (v >> 8) & 255, v & 255] for v in values], np.uint8)
    else:  # class -> mask value
        lut = np.array(values, np.uint8 if max(values) < 256 else np.uint16)
    for path, image, lg, (height, width) in zip(paths, images, logits, sizes):
        lg = lg[:, :height, :width].float()  # the padding cut off
        if (height, width) != (image.height, image.width):
            lg = F.interpolate(lg[None], (image.height, image.width), mode="bilinear")[0]
        classes = predicted_classes(lg[None], num_classes)[0].cpu()
        Image.fromarray(lut[classes.numpy()]).save(out / f"{Path(path).stem}_mask.png")
        if overlay:  # in the dataset's colours, where it has them
            rgb = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
            painted = painted_on(
                rgb, classes, colours=record["colours"], background=record["background"]
            )
            Image.fromarray(painted.numpy()).save(out / f"{Path(path).stem}_overlay.png")


def sample_images(val_pairs, record, *, multiple, source, count=4):
    """([images, image], what they are): inputs to check an export on. Up to `count` of the
    recipe's validation pairs (its Pairs, or None: no data here), as the data gives them (uint8
    [N, C, H, W]), at the size the model was trained on (model_size() of the first one, padded),
    and the first one again at another size (16 and 32 pixels more). With no data, random pixels
    of that size, or EXPORT_SIZE for a model trained at its images' own sizes: its weights came
    from data that need not be here. source: where the pairs are from, or why there are none."""
    from torchvision.transforms.v2.functional import pil_to_tensor, resize  # see decode_pair

    in_channels = record["model"]["in_channels"]
    if val_pairs is None:
        h, w = record["input_size"] or (EXPORT_SIZE, EXPORT_SIZE)
        shape = (count, in_channels, h + 16, w + 32)
        seeded = torch.Generator().manual_seed(0)
        x = torch.randint(0, 256, shape, dtype=torch.uint8, generator=seeded)
        return [x[..., :h, :w], x[:1]], f"random pixels: {source}"
    images = [
        pil_to_tensor(val_pairs[i][0].convert(MODES[in_channels]))
        for i in range(min(count, len(val_pairs)))
    ]
    h, w = model_size(record, *images[0].shape[1:])
    if record["input_size"] is None or record["scale"]:  # sizes that vary: padded as in training
        h, w = padded(h, multiple), padded(w, multiple)
    return [
        torch.stack([resize(im, [h, w], antialias=True) for im in images]),
        resize(images[0], [h + 16, w + 32], antialias=True)[None],
    ], f"images of {source}"
