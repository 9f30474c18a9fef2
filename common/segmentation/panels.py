"""Segmentation drawn: classes painted in colours, the trackers' image | prediction | truth
panels, predict's overlays, and the data check's sheet with its key.

    panel = image_panel(x, logits, y, num_classes)      # image | prediction | truth, floats
    save_overlays(samples, "check.png", labels=names)   # the data check's sheet
"""

import torch
from PIL import Image, ImageDraw

from common.segmentation.inference import predicted_classes
from common.tracking import as_rgb

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


VOID_COLOUR = (224, 224, 192)  # ignored pixels, as Pascal VOC draws its void


def paint(classes, colours=None):
    """Class indices [..., H, W] -> uint8 colours [..., H, W, 3]: the dataset's own `colours`
    ([[r, g, b]] per class, where it has them), else COLOURS; ignored pixels (negative) in
    VOID_COLOUR."""
    if colours is None:
        index = torch.where(classes > 0, (classes - 1) % (len(COLOURS) - 1) + 1, 0)
        painted = COLOURS.to(classes.device)[index]
    else:
        table = torch.tensor(colours, dtype=torch.uint8, device=classes.device)
        painted = table[classes.clamp(min=0)]
    void = torch.tensor(VOID_COLOUR, dtype=torch.uint8, device=classes.device)
    return torch.where((classes < 0)[..., None], void, painted)


def image_panel(x, logits, target, num_classes, count=4, colours=None):
    """image | prediction | truth of the first `count` images, side by side: floats
    [N, 3, H, 3W], the classes in the dataset's `colours` if it has them (paint)."""
    pred = predicted_classes(logits[:count], num_classes)
    painted = [paint(c, colours).permute(0, 3, 1, 2) for c in (pred, target[:count])]
    return torch.cat([as_rgb(x[:count]), *painted], dim=3).float() / 255


def overlay(image, classes, *, colours=None, background=0):
    """An image uint8 [C, H, W] with its classes [H, W] painted on at half strength, where they
    are not the background: uint8 [H, W, 3]."""
    rgb = as_rgb(image[None])[0].permute(1, 2, 0).float()
    painted = 0.5 * rgb + 0.5 * paint(classes, colours).float()
    return torch.where((classes != background)[..., None], painted, rgb).to(torch.uint8)


def save_overlays(samples, path, *, colours=None, background=0, labels=(), height=192):
    """One PNG of a row per (image uint8 [C, H, W], classes [H, W]) sample: the image, the image
    with its classes painted on (overlay), and the classes alone, each row scaled to at most
    `height` pixels high: what the model is trained on, to look at before training. Under them,
    the key (legend) to the colours of the classes, whose `labels` it writes."""

    rows = []
    for image, classes in samples:
        row = torch.cat(
            [
                as_rgb(image[None])[0].permute(1, 2, 0),
                overlay(image, classes, colours=colours, background=background),
                paint(classes, colours),
            ],
            dim=1,
        )
        row = Image.fromarray(row.cpu().numpy())
        if row.height > height:
            row = row.resize((row.width * height // row.height, height), Image.BILINEAR)
        rows.append(row)
    void = any(bool((classes < 0).any()) for _, classes in samples)
    rows.append(legend(labels, colours, max(r.width for r in rows), void=void))
    sheet = Image.new("RGB", (max(r.width for r in rows), sum(r.height + 4 for r in rows)))
    top = 0
    for row in rows:
        sheet.paste(row, (0, top))
        top += row.height + 4
    sheet.save(path)


def legend(labels, colours, width, *, void=False, line=14):
    """A PIL image of each class's colour (paint's) beside its label, as many to a line as fit
    `width` pixels (at least one), white text on black; void: the colour of ignored pixels too."""

    painted = paint(torch.arange(len(labels)), colours).tolist()
    keys = [*zip(painted, labels), *([(list(VOID_COLOUR), "ignored")] if void else [])]
    placed, left, top = [], 0, 0
    for colour, label in keys:
        size = line + 4 + 6 * len(str(label)) + 12  # swatch, gap, text (6 pixels a character)
        if left and left + size > width:
            left, top = 0, top + line
        placed.append((left, top, colour, str(label)))
        left += size
    sheet = Image.new("RGB", (max(width, left), top + line))
    draw = ImageDraw.Draw(sheet)
    for left, top, colour, label in placed:
        swatch = [left + 1, top + 1, left + line - 2, top + line - 2]  # outlined: black shows
        draw.rectangle(swatch, fill=tuple(colour), outline="white")
        draw.text((left + line + 4, top + 1), label, fill="white")
    return sheet
