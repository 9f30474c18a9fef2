"""What goes to the experiment trackers besides scalars: segmentation panels.

panel = image_panel(x, logits, y, num_classes)   # image | prediction | truth, floats
tracker.log_images({"eval/image_prediction_truth": panel.cpu()}, step=step)
"""

import torch

from common.inference import predicted_classes

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
