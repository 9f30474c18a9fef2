"""Write the shapes dataset for recipes/unet.py: circles, rectangles and triangles with exact masks.

    python scripts/make_shapes.py                 # 200 images of 64x64 in data/shapes
    python scripts/make_shapes.py --out /tmp/shapes --count 40 --size 48
    python scripts/make_shapes.py --out data/shapes_mixed \
        --sizes 48,64,96                          # mixed sizes, for bucket_by_size
    python scripts/make_shapes.py --out /tmp/carvana --count 40 --size 1918x1280 \
        --image_format jpg --mask_format gif      # Carvana's sizes and file types
    python scripts/make_shapes.py --colours random --clutter 4 --count 1200 --size 96 --seed 1 \
        --out data/shapes_shape                   # `make data/shapes_shape`: shape-coded
    python scripts/make_shapes.py --binary --count 600 --size 96 \
        --out data/shapes_binary                  # `make data/shapes_binary`: one object class

The layout is the Carvana one that the recipe reads, so the demo and the tests use the real
loading path: imgs/shape_0000.png (RGB) and masks/shape_0000_mask.png (8-bit greyscale), or with
--image_format jpg and --mask_format gif, imgs/shape_0000.jpg and masks/shape_0000_mask.gif (a
palette of greys, so that the values read back as they are), as Carvana's files are.
Mask values are grey levels, so a mask can be looked at and the recipe's value -> class
mapping is exercised:

    0 background    85 circle    170 rectangle    255 triangle

Each image has 1 to 3 shapes of random size and place on a noisy greyish background; a later
shape covers an earlier one. Each class has its own family of colours (circles reddish,
rectangles greenish, triangles bluish, at random brightness), so a small U-Net learns the task
in a minute on a CPU; shape alone takes far longer. The masks are exact: a mask pixel is the
class of the shape painted on that image pixel (no antialiasing). Image i depends only on
(--seed, i), so the first 40 images of --count 200 are the images of --count 40.

Two other kinds, for measuring what the U-Net learns (docs/unet.md, "Learning your classes"):
- --colours random (with --clutter N): each shape in a random colour over a gradient between two
  random colours with N strokes, rings and boxes in random colours that are background
  (make_digits.py's background): only a shape's form tells its class, as in real data.
- --binary: every shape is one class (mask 255), as in Carvana's or ISIC's masks: object or not.
"""

import argparse
import colorsys
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

MASK_VALUES = {"circle": 85, "rectangle": 170, "triangle": 255}
HUES = {"circle": 0.0, "rectangle": 1 / 3, "triangle": 2 / 3}  # red, green, blue


def random_colour(rng, away_from=None, distance=120):
    """An RGB colour [3] of any hue, saturation and brightness; with `away_from`, at least
    `distance` from that colour (Euclidean, 0..255 per channel), so that it stays visible."""
    while True:
        colour = 255 * np.array(colorsys.hsv_to_rgb(*rng.uniform((0, 0, 0.15), (1, 1, 1))))
        if away_from is None or np.linalg.norm(colour - away_from) >= distance:
            return colour


def clutter_background(rng, size, count):
    """A float RGB background [size, size, 3]: a linear gradient between two random colours in a
    random direction, `count` strokes, rings and boxes in random colours, and noise."""
    start, end = random_colour(rng), random_colour(rng)
    angle = rng.uniform(0, 2 * np.pi)
    yy, xx = np.mgrid[0:size, 0:size] / (size - 1)
    t = (np.cos(angle) * xx + np.sin(angle) * yy + 1.5) / 3  # 1/6..5/6 across the image
    image = Image.fromarray((start + (end - start) * t[..., None]).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(count):  # clutter: background, though some of it looks like ink
        fill = tuple(int(v) for v in random_colour(rng))
        x0, y0, x1, y1 = rng.uniform(-0.1, 1.1, 4) * size
        box = [min(x0, x1), min(y0, y1), max(x0, x1), max(y0, y1)]
        width = int(rng.integers(2, 6))
        kind = rng.integers(3)
        if kind == 0:
            draw.line([x0, y0, x1, y1], fill=fill, width=width)
        elif kind == 1:
            draw.ellipse(box, outline=fill, width=width)
        else:
            draw.rectangle(box, outline=fill, width=width)
    return np.asarray(image, float) + rng.normal(0, 15, (size, size, 3))


def shape_pixels(kind, height, width, rng):
    """A boolean [height, width] array: the pixels whose centres fall inside a random shape."""
    yy, xx = np.mgrid[:height, :width] + 0.5
    cx, cy = rng.uniform(0.15, 0.85, 2) * (width, height)
    r = rng.uniform(0.12, 0.25) * min(height, width)
    if kind == "circle":
        return (xx - cx) ** 2 + (yy - cy) ** 2 <= r**2
    if kind == "rectangle":
        half_w, half_h = r * rng.uniform(0.5, 1.0, 2)
        return (abs(xx - cx) <= half_w) & (abs(yy - cy) <= half_h)
    # triangle: three corners on a circle of radius r, at a random rotation; a pixel is inside
    # when it is on the same side of all three edges.
    angles = rng.uniform(0, 2 * np.pi) + np.array([0, 2, 4]) * np.pi / 3
    px, py = cx + r * np.cos(angles), cy + r * np.sin(angles)
    sides = [
        (px[j] - px[i]) * (yy - py[i]) - (py[j] - py[i]) * (xx - px[i])
        for i, j in ((0, 1), (1, 2), (2, 0))
    ]
    return ((sides[0] >= 0) & (sides[1] >= 0) & (sides[2] >= 0)) | (
        (sides[0] <= 0) & (sides[1] <= 0) & (sides[2] <= 0)
    )


def make_pair(i, sizes, seed, *, colours="class", clutter=0, binary=False):
    """Image i: (uint8 RGB [H, W, 3], uint8 mask [H, W]), H and W each drawn from `sizes`, or the
    (width, height) of `sizes` when it is a tuple. colours: class (a hue family per kind of
    shape, on a greyish background) or random (any colour, on a gradient with `clutter` shapes);
    binary: every shape's mask value is 255."""
    if isinstance(sizes, tuple):
        width, height = sizes
    elif len(sizes) > 1:
        height, width = np.random.default_rng((seed, i, 1)).choice(sizes, 2)
    else:
        height = width = sizes[0]
    rng = np.random.default_rng((seed, i))
    if colours == "class":
        image = rng.uniform(40, 215) + rng.uniform(-15, 15, 3)
        image = image + rng.normal(0, 18, (height, width, 3))
    else:
        image = clutter_background(rng, height, clutter)
    mask = np.zeros((height, width), np.uint8)
    for _ in range(rng.integers(1, 4)):
        kind = rng.choice(list(MASK_VALUES))
        if colours == "class":
            hue = (HUES[kind] + rng.uniform(-0.06, 0.06)) % 1
            hsv = (hue, rng.uniform(0.6, 1), rng.uniform(0.5, 1))
            color = 255 * np.array(colorsys.hsv_to_rgb(*hsv))
        pixels = shape_pixels(kind, height, width, rng)
        if colours == "random":  # any colour that stands out from the background under it
            color = random_colour(rng, away_from=image[pixels].mean(0))
        image[pixels] = color + rng.normal(0, 18, (pixels.sum(), 3))
        mask[pixels] = 255 if binary else MASK_VALUES[kind]
    return np.clip(image, 0, 255).astype(np.uint8), mask


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/shapes", help="folder to write imgs/ and masks/ into")
    p.add_argument("--count", type=int, default=200, help="number of images")
    p.add_argument(
        "--size", default="64", help="height and width in pixels, or WxH (width x height)"
    )
    p.add_argument(
        "--sizes", help="comma-separated sizes: each image's height and width are drawn from them"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image_format", choices=["png", "jpg"], default="png")
    p.add_argument("--mask_format", choices=["png", "gif"], default="png")
    p.add_argument(
        "--colours",
        choices=("class", "random"),
        default="class",
        help="class: a hue family per kind of shape, which gives the class away; random: only "
        "the form tells (square images only)",
    )
    p.add_argument(
        "--clutter", type=int, default=0, help="--colours random: background shapes per image"
    )
    p.add_argument("--binary", action="store_true", help="one class: every shape is mask 255")
    args = p.parse_args()
    if args.sizes:
        sizes = [int(v) for v in args.sizes.split(",")]
    elif "x" in args.size:
        sizes = tuple(int(v) for v in args.size.split("x"))
    else:
        sizes = [int(args.size)]
    if args.colours == "random" and (isinstance(sizes, tuple) or len(sizes) > 1):
        p.error("--colours random makes square images of one --size")

    out = Path(args.out)
    (out / "imgs").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    greys = [v for level in range(256) for v in (level, level, level)]
    for i in range(args.count):
        image, mask = make_pair(
            i, sizes, args.seed, colours=args.colours, clutter=args.clutter, binary=args.binary
        )
        Image.fromarray(image).save(out / "imgs" / f"shape_{i:04d}.{args.image_format}")
        mask = Image.fromarray(mask)
        if args.mask_format == "gif":  # a palette of greys: index v is grey level v
            mask = Image.frombytes("P", mask.size, mask.tobytes())
            mask.putpalette(greys)
        # optimize=False: GIF would otherwise renumber the palette, each mask its own way.
        mask.save(out / "masks" / f"shape_{i:04d}_mask.{args.mask_format}", optimize=False)
    if isinstance(sizes, tuple):
        shape = f"{sizes[0]}x{sizes[1]}"
    elif len(sizes) == 1:
        shape = f"{sizes[0]}x{sizes[0]}"
    else:
        shape = f"heights and widths from {args.sizes}"
    print(f"wrote {args.count} images of {shape} and their masks to {out}/")


if __name__ == "__main__":
    main()
