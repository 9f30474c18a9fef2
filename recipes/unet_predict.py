"""The U-Net's serving: predict, export and the data check, with the recipe's own model, input
conversion and data (recipes/unet.py, which trains, and what it imports):

    python recipes/unet_predict.py --weights runs/unet/model.safetensors "photos/*.jpg" --overlay
    python recipes/unet_predict.py --export onnx --weights runs/unet/model.safetensors
    python recipes/unet_predict.py --check_data --images data/x/imgs --masks data/x/masks

Its settings are the recipe's Config and predict's own (ServingConfig); `python recipes/unet.py
--predict ...` runs this file in its place. A copy of the recipe copies this file too and points its
one import marked ADAPT at the copy's recipe (recipes/unet.py never imports this file).
"""

import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from common.accelerator import accelerator_for, close
from common.checkpoint import load_weights
from common.config import UserError
from common.data import IMAGE_SUFFIXES, DataError, image_files
from common.export import OnnxModel, export_onnx
from common.runtime import run_serving
from common.segmentation.data import MODES, pad_to, padded, show_value
from common.segmentation.inference import predicted_classes, segment
from common.segmentation.panels import overlay as painted_on
from common.segmentation.panels import save_overlays
from unet import (  # ADAPT: your recipe
    NAME,
    PAD_MULTIPLE,
    Config,
    Pairs,
    build_model,
    flips_to_average,
    list_pairs,
    prepare_input,
    read_trained,
    settle,
    start_up_notes,
)


@dataclass
class ServingConfig(Config):
    # Predict (--predict GLOB): masks for new images with `weights`, which record the model.
    predict_dir: str | None = None  # where NAME_mask.png go; default: predictions/ beside weights
    overlay: bool = False  # also write NAME_overlay.png, the image with the classes painted on


def serve(cfg):
    """--predict, --export or --check_data, on the processes of the accelerate config."""
    accelerator = accelerator_for(cfg)
    if cfg.predict:
        predict(cfg, accelerator)
    elif cfg.export:
        export(cfg, accelerator)
    else:
        check_data(cfg, accelerator)
    close(accelerator)


def trained_model(path, device="cpu"):
    """(model, record) for predict and export: the model that the weights file's record
    describes (read_trained), with its weights, in eval mode; for an .onnx file, an onnxruntime
    session that is called alike."""
    record = read_trained(path)
    if record is None:
        raise UserError(
            f"{path} holds no settings of this recipe: predict and export need a model.safetensors "
            f"that its training wrote (train again if an older version wrote it)"
        )
    if Path(path).suffix == ".onnx":
        return OnnxModel(path), record
    model = build_model(record["model"])
    load_weights(model, path)
    return model.to(device).eval(), record


def predict(cfg, accelerator):
    """A mask PNG per image of the --predict glob, at the image's size, in the training masks'
    values or colours; --overlay also paints the classes on the image. Each process does a
    share, in batches of eval_batch_size (0: batch_size)."""
    model, record = trained_model(cfg.weights, accelerator.device)
    cfg = replace(cfg, **record["model"])  # the model's settings: prepare_input as in training
    flips = flips_to_average(cfg, record["flips"])
    out = Path(cfg.predict_dir or Path(cfg.weights).parent / "predictions")  # beside the weights
    out.mkdir(parents=True, exist_ok=True)
    files = predict_files(cfg.predict)
    batches = predict_batches(
        files,
        record,
        batch_size=cfg.eval_batch_size or cfg.batch_size,
        accelerator=accelerator,
        multiple=PAD_MULTIPLE,
    )
    for paths, images, x, sizes in batches:
        with torch.inference_mode(), accelerator.autocast():
            x_in = prepare_input(x, cfg)
            logits = segment(model, x_in, tile=cfg.predict_tile, flips=flips, multiple=PAD_MULTIPLE)
        write_masks(paths, images, logits, record, out, sizes=sizes, overlay=cfg.overlay)
    accelerator.wait_for_everyone()
    values = [show_value(v, record["colour_masks"]) for v in record["mask_values"]]
    if record["class_names"]:
        values = [f"{v} {name}" for v, name in zip(values, record["class_names"])]
    accelerator.print(f"wrote {len(files)} masks (values {', '.join(values)}) to {out}/")


def export(cfg, accelerator):
    """--export onnx: the weights as an .onnx file beside them, checked against PyTorch on
    validation images of the data that --dataset or --images names, or on random pixels of the
    trained size without them (the weights need not come with their data); common/export.py."""
    model, record = trained_model(cfg.weights)
    cfg = replace(cfg, **record["model"])  # the model's settings: prepare_input as in training
    images, what = export_inputs(cfg, record)
    export_onnx(
        accelerator,
        model,
        inputs=[prepare_input(x, cfg) for x in images],
        weights=cfg.weights,
        metadata={"recipe": NAME},
        dynamic={0: "batch", 2: "height", 3: "width"},  # any size
        what=what,
    )


def export_inputs(cfg, record):
    """(inputs, what they are) that check an export (sample_images): the data of the settings,
    where they name some; the recipe's default data need not be the weights'."""
    if cfg.dataset == Config.dataset and not cfg.images:  # no data named
        source = f"no --images, and --dataset at the default {Config.dataset}"
        return sample_images(None, record, multiple=PAD_MULTIPLE, source=source)
    val_pairs = Pairs(list_pairs(cfg)[1])
    return sample_images(val_pairs, record, multiple=PAD_MULTIPLE, source=cfg.images or cfg.dataset)


def check_data(cfg, accelerator, count=8):
    """--check_data: the data read as training reads it, with the same one-line errors; then
    each class's share of the training pixels, every start-up note, and the first `count`
    training images as the model sees them, with their masks painted on, and the key to the
    classes' colours, in output_dir/data_check.png. No training, no checkpoint."""
    settled, data, _ = settle(cfg, accelerator)  # as training settles it, --weights' classes too
    accelerator.print(f"{NAME} data check: {MODES[data.in_channels]} images; {data}")
    for line in [*data.table, *start_up_notes(settled, data, cfg)]:
        if line:
            accelerator.print(line)
    if accelerator.is_main_process:
        train_set = data.train_loader.dataset
        samples = list(zip(*train_set.read(range(min(count, len(train_set))))))  # as they are
        path = Path(cfg.output_dir) / "data_check.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        labels = [f"{i}: {name}" for i, name in enumerate(data.names)]  # a name, or a mask value
        save_overlays(
            samples, path, colours=data.colours, background=data.background, labels=labels
        )
        print(f"wrote {path}: {len(samples)} training images, their classes painted on, a key")


# ---- New image files as model inputs, and the masks written back ----

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


if __name__ == "__main__":  # unet_predict.py --weights W "photos/*.jpg"
    run_serving(serve, ServingConfig, recipe=NAME, script=__file__)
