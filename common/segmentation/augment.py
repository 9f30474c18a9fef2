"""Augmentation of a segmentation batch, images and masks alike, from per-sample random numbers,
on the batch's device (the GPU when the images are cached there).

    images, masks = crop_and_flip(images, masks, rand[:, :4], crop=256, hflip=0.5)
    images, masks = zoom_and_rotate(images, masks, rand[:, 4:8], zoom=0.25, rotate=15)
    images = colour_jitter(images, rand[:, 8:11], 0.3)
    images, masks = copy_paste(images, masks, others, other_masks, background=0)
"""

import torch
import torch.nn.functional as F


def crop_and_flip(images, masks, rand, *, crop=0, hflip=0.0, vflip=0.0):
    """The same crop and flips for each image of a batch and its mask, per sample, on the batch's
    device: a crop x crop window at a random place (rand[n, 0] and rand[n, 1]; crop 0: the
    whole image), flipped left to right if rand[n, 2] < hflip and upside down if rand[n, 3] <
    vflip. images [N, C, H, W], masks [N, H, W]. One gather per tensor, with the rows and
    columns each sample takes: no loop over the samples, and no wait for a GPU."""
    if not (crop or hflip or vflip):
        return images, masks
    n, _, height, width = images.shape
    h, w = crop or height, crop or width
    rand, device = rand.to(images.device), images.device
    top = (rand[:, 0] * (height - h + 1)).long().clamp(max=height - h)[:, None]
    left = (rand[:, 1] * (width - w + 1)).long().clamp(max=width - w)[:, None]
    rows, cols = torch.arange(h, device=device)[None], torch.arange(w, device=device)[None]
    rows = torch.where(rand[:, 3:4] < vflip, h - 1 - rows, rows) + top  # [N, h]
    cols = torch.where(rand[:, 2:3] < hflip, w - 1 - cols, cols) + left  # [N, w]
    batch, rows, cols = (
        torch.arange(n, device=device)[:, None, None],
        rows[:, :, None],
        cols[:, None],
    )
    # Indexing with a slice between the index tensors puts the channels last: [N, h, w, C].
    return images[batch, :, rows, cols].permute(0, 3, 1, 2).contiguous(), masks[batch, rows, cols]


def copy_paste(images, masks, sources, source_masks, background):
    """Each image of a batch with the objects of another on top (the semantic form of the
    "simple copy-paste" of Ghiasi et al., torchvision's SimpleCopyPaste): every pixel of
    sources[n] whose class in source_masks[n] is not `background`, ignored pixels too (a void
    band around an object goes with it), replaces that pixel in images[n] and masks[n]. uint8
    images [N, C, H, W], class masks [N, H, W], the sources alike and of the same size."""
    pasted = source_masks != background
    return torch.where(pasted[:, None], sources, images), torch.where(pasted, source_masks, masks)


def zoom_and_rotate(images, masks, rand, *, zoom=0.0, rotate=0.0, fill="reflect"):
    """Each image of a batch and its mask resized by a factor from 1 / (1 + zoom) to 1 + zoom
    (rand[n, 0], uniform on a log scale), rotated about the centre by up to `rotate` degrees
    either way (rand[n, 1]), and moved (rand[n, 2] and rand[n, 3]): zoomed in, a random window
    of it fills the frame; zoomed out, it lies at a random place in the frame. The size stays;
    the image is resampled bilinearly, the mask by nearest neighbour. What comes from outside
    the image is IGNORE (-1) in the mask, and in the image its mirror image across the edge
    (fill "reflect") or 0 (fill "zeros", torchvision's fill). images uint8 [N, C, H, W],
    masks class indices [N, H, W] (IGNORE where ignored); one grid_sample per tensor, on the
    batch's device. zoom and rotate 0: the batch itself."""
    if not (zoom or rotate):
        return images, masks
    n, _, height, width = images.shape
    rand = rand.to(images.device, torch.float32)
    factor = (1 + zoom) ** (2 * rand[:, 0] - 1)
    angle = torch.deg2rad(rotate * (2 * rand[:, 1] - 1))
    cos, sin = angle.cos() / factor, angle.sin() / factor
    # Output -> input coordinates in affine_grid's units, which run from -1 to 1 along each side:
    # rotated in pixels (hence height / width), and moved within what keeps the frame covered
    # (zoomed in) or the image whole (zoomed out).
    shift = (1 - 1 / factor).abs()[:, None] * (2 * rand[:, 2:4] - 1)
    theta = torch.stack(
        [
            torch.stack([cos, -sin * height / width, shift[:, 0]], 1),
            torch.stack([sin * width / height, cos, shift[:, 1]], 1),
        ],
        1,
    )
    grid = F.affine_grid(theta, [n, 1, height, width], align_corners=False)
    # The classes + 1, so that the zeros from outside become IGNORE, and ignored pixels stay so;
    # and ones, which say what lies inside the image.
    labels = torch.stack([masks + 1, torch.ones_like(masks)], 1).float()
    labels, inside = F.grid_sample(labels, grid, mode="nearest", align_corners=False).unbind(1)
    # Past its edges the image is mirrored across them (reflection); for zeros, its edge pixels
    # are repeated (border), so that no zero darkens them, and then what lies outside is 0.
    padding = "reflection" if fill == "reflect" else "border"
    moved = F.grid_sample(
        images.float(), grid, mode="bilinear", padding_mode=padding, align_corners=False
    )
    if fill == "zeros":
        moved = moved * inside[:, None]
    moved = moved.round_().clamp_(0, 255)
    return moved.to(images.dtype), labels.to(masks.dtype) - 1


def colour_jitter(images, rand, strength):
    """Brightness, contrast and saturation of each image of a batch times its own factors from
    1 - strength to 1 + strength (rand[n, 0], rand[n, 1], rand[n, 2]), as torchvision's
    ColorJitter: brightness scales the pixels, contrast moves them from the image's mean grey,
    saturation from each pixel's grey. Grey images (1 or 2 channels) get brightness and
    contrast, and an alpha channel stays. uint8 [N, C, H, W] in and out, on the batch's device;
    strength 0: the batch itself."""
    if not strength:
        return images
    rand = rand.to(images.device, torch.float32)
    brightness, contrast, saturation = 1 + strength * (2 * rand.T[:3, :, None, None, None] - 1)
    colours = 3 if images.shape[1] >= 3 else 1
    x = (images[:, :colours].float() * brightness).clamp(0, 255)
    mean = grey(x).mean((2, 3), keepdim=True)
    x = ((x - mean) * contrast + mean).clamp(0, 255)
    if colours == 3:
        luminance = grey(x)
        x = ((x - luminance) * saturation + luminance).clamp(0, 255)
    return torch.cat([x.round().to(images.dtype), images[:, colours:]], 1)


def grey(x):
    """The luminance [N, 1, H, W] of RGB floats [N, 3, H, W] (ITU-R 601, as torchvision's
    rgb_to_grayscale), or grey images themselves."""
    if x.shape[1] == 1:
        return x
    weights = torch.tensor([0.299, 0.587, 0.114], device=x.device).view(1, 3, 1, 1)
    return (x * weights).sum(1, keepdim=True)
