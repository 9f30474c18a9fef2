"""A segmentation model's logits of whole images, as evaluation and predict both compute them:
at once, from overlapping tiles, and averaged over flips.

    logits = segment(model, x, tile=256, flips="h", multiple=16)   # [N, classes, H, W]
    classes = predicted_classes(logits, num_classes)                # [N, H, W]
"""

import itertools

import torch


def predicted_classes(logits, num_classes):
    """Hard predictions [N, H, W]: argmax, or logit > 0 (sigmoid > 0.5) for one class."""
    return (logits[:, 0] > 0).long() if num_classes == 1 else logits.argmax(1)


def tile_starts(size, tile, multiple):
    """Where the tiles along an image side of `size` pixels start: every `stride` pixels, a
    multiple of `multiple` so that each tile meets the model's pooling grid where the whole
    image would, overlapping by a quarter of a tile or more; the last tile ends at the edge."""
    stride = max(multiple, (tile - tile // 4) // multiple * multiple)
    return [*range(0, size - tile, stride), size - tile]


def gaussian_weights(height, width, device):
    """[height, width] weights for blending tiles, highest at the centre (sigma 1/8 of the side,
    as nnU-Net): the logits near a tile's edge, which saw the zero padding past it, count least."""

    def side(n):
        offsets = torch.arange(n, dtype=torch.float32, device=device) - (n - 1) / 2
        return torch.exp(-0.5 * (offsets / (n / 8)) ** 2)  # 3e-4 at the edge, never 0

    return side(height)[:, None] * side(width)[None]


def tiled(net, x, tile, multiple=16):
    """net(x) for images x [N, C, H, W], or, where they are larger than tile x tile, the logits
    of overlapping tiles blended with Gaussian weights. The network sees one tile at a time, so
    its memory grows with the tile; only the logits (fp32) grow with the image."""
    height, width = x.shape[-2:]
    if not tile or (height <= tile and width <= tile):
        return net(x)
    tile_h, tile_w = min(tile, height), min(tile, width)
    weights = gaussian_weights(tile_h, tile_w, x.device)
    logits = total = None
    starts = itertools.product(
        tile_starts(height, tile_h, multiple), tile_starts(width, tile_w, multiple)
    )
    for top, left in starts:
        window = (..., slice(top, top + tile_h), slice(left, left + tile_w))
        part = net(x[window]).float()
        if logits is None:
            logits = part.new_zeros((*part.shape[:2], height, width))
            total = part.new_zeros((height, width))
        logits[window] += part * weights
        total[window] += weights
    return logits.div_(total)


def segment(net, x, *, tile=0, flips="", multiple=16):
    """The logits of images x [N, C, H, W]: net(x), or with `tile`, from tiles (tiled()), and with
    `flips` ("h", "v" or both), the mean over the image and its flips along those axes: those the
    model was trained to flip. The mean of the logits, not of the probabilities: it stays logits,
    for the loss, the argmax and the tiles' blend, and one class (sigmoid) and several (softmax)
    are averaged alike. multiple: tiles start on this grid (the model's pooling)."""
    axes = [dim for axis, dim in (("v", 2), ("h", 3)) if axis in flips]
    if not axes:
        return tiled(net, x, tile, multiple)
    views = [dims for n in range(len(axes) + 1) for dims in itertools.combinations(axes, n)]
    logits = sum(tiled(net, x.flip(dims), tile, multiple).float().flip(dims) for dims in views)
    return logits / len(views)
