"""Write a VOC-like segmentation set for recipes/unet.py: objects of 10 classes on mostly
background, each outlined by a void band, as Pascal VOC's masks are.

    python scripts/make_digits.py                     # 1200 images of 96x96 in data/digits
    python scripts/make_digits.py --colours random --digit_size 0.46,0.625 --band 2 --clutter 4 \
        --out data/digits_shape                       # `make data/digits_shape`: shape-coded
    python scripts/make_digits.py --out /tmp/digits --count 240 --digit_size 0.3,0.5

Each image holds 1 to 3 handwritten digits from data/mnist_sample (its train split, 4000 real
MNIST digits), each scaled to a share of the image's side (--digit_size; 15% to 22%, 14 to 21
pixels, by default). The mask is a palette PNG, as VOC's are: 0 background, 1 to 10 the digits
0 to 9, and 255 (void) on a band --band pixels wide around each digit. Two kinds of data:
- --colours class (the default, data/digits): each digit in a colour of its digit's family (a hue
  per digit) on a noisy greyish background. Colour gives the class away: a model can learn the
  classes without their shapes. 95% of the pixels are background, 4% void, and each digit class
  holds about 0.1%: the imbalance under which the recipe's defaults learn a few classes and the
  background (docs/unet.md, "Learning your classes").
- --colours random (data/digits_shape): each digit in a random colour, over a noisy gradient
  between two random colours with --clutter strokes, rings and boxes in random colours that are
  background: only a digit's shape tells its class, as in real data.
The layout is imgs/digit_0000.png and masks/digit_0000.png, which the recipe reads as it is.
Image i depends only on (--seed, i) and the settings.
"""

import argparse
import colorsys
import io
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from make_shapes import clutter_background, random_colour
from PIL import Image

VOID = 255
BAND = 3  # pixels of void around a digit
# VOC's palette for the first 11 indices (background, then a colour per class); void is white-ish.
PALETTE = [
    (0, 0, 0),
    (128, 0, 0),
    (0, 128, 0),
    (128, 128, 0),
    (0, 0, 128),
    (128, 0, 128),
    (0, 128, 128),
    (128, 128, 128),
    (64, 0, 0),
    (192, 0, 0),
    (64, 128, 0),
]


def load_digits(path):
    """(uint8 images [N, 28, 28], labels [N]) of a parquet split of data/mnist_sample."""
    table = pq.read_table(path).to_pydict()
    images = [np.asarray(Image.open(io.BytesIO(im["bytes"]))) for im in table["image"]]
    return np.stack(images), np.asarray(table["label"])


def grow(mask, pixels):
    """`mask` grown by `pixels` in every direction (a square neighbourhood)."""
    grown = mask.copy()
    for dy in range(-pixels, pixels + 1):
        for dx in range(-pixels, pixels + 1):
            grown |= np.roll(np.roll(mask, dy, 0), dx, 1)
    return grown


def make_pair(
    i, digits, labels, *, size, seed, scale=(0.15, 0.22), colours="class", band=BAND, clutter=0
):
    """Image i: (uint8 RGB [size, size, 3], uint8 mask [size, size]); each digit's side is a
    share of the image's side drawn from `scale`. colours: class (a hue per digit, on a greyish
    background) or random (any colour, on a gradient with `clutter` shapes)."""
    rng = np.random.default_rng((seed, i))
    if colours == "class":
        background = rng.uniform(60, 200) + rng.uniform(-10, 10, 3)  # greyish
        image = background + rng.normal(0, 20, (size, size, 3))
    else:
        image = clutter_background(rng, size, clutter)
    mask = np.zeros((size, size), np.uint8)
    for _ in range(rng.integers(1, 4)):
        k = rng.integers(len(digits))
        side = int(rng.uniform(*scale) * size)
        ink = np.asarray(Image.fromarray(digits[k]).resize((side, side), Image.BILINEAR)) > 100
        top, left = rng.integers(band, size - side - band, 2)
        on = np.zeros((size, size), bool)
        on[top : top + side, left : left + side] = ink
        if colours == "class":
            # A colour of the digit's own family (a hue per digit, at random saturation and
            # brightness), as make_shapes.py colours its shapes: the classes are told apart by
            # colour as well as by shape, so that a small model learns them in minutes on a CPU.
            hue = (labels[k] / 10 + rng.uniform(-0.03, 0.03)) % 1
            colour = 255 * np.array(
                colorsys.hsv_to_rgb(hue, rng.uniform(0.6, 1), rng.uniform(0.6, 1))
            )
        else:  # any colour that stands out from the background under the digit
            colour = random_colour(rng, away_from=image[on].mean(0))
        edge = grow(on, band) & ~on
        mask[edge & (mask == 0)] = VOID  # a later digit covers an earlier one's band
        image[on] = colour + rng.normal(0, 20, (on.sum(), 3))
        mask[on] = labels[k] + 1
    return np.clip(image, 0, 255).astype(np.uint8), mask


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/digits", help="folder to write imgs/ and masks/ into")
    p.add_argument("--count", type=int, default=1200, help="number of images")
    p.add_argument("--size", type=int, default=96, help="height and width in pixels")
    p.add_argument("--digits", default="data/mnist_sample/train.parquet", help="MNIST parquet")
    p.add_argument(
        "--digit_size",
        default="0.15,0.22",
        help="a digit's side as a share of the image's: MIN,MAX",
    )
    p.add_argument(
        "--colours",
        choices=("class", "random"),
        default="class",
        help="class: a hue per digit, which gives the class away; random: only shape tells",
    )
    p.add_argument("--band", type=int, default=BAND, help="pixels of void around each digit")
    p.add_argument(
        "--clutter", type=int, default=0, help="--colours random: background shapes per image"
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    digits, labels = load_digits(args.digits)
    out = Path(args.out)
    (out / "imgs").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    palette = [v for rgb in PALETTE for v in rgb] + [0] * 3 * (VOID - len(PALETTE))
    palette += [224, 224, 192]  # VOC's colour of void
    for i in range(args.count):
        scale = tuple(float(v) for v in args.digit_size.split(","))
        image, mask = make_pair(
            i,
            digits,
            labels,
            size=args.size,
            seed=args.seed,
            scale=scale,
            colours=args.colours,
            band=args.band,
            clutter=args.clutter,
        )
        Image.fromarray(image).save(out / "imgs" / f"digit_{i:04d}.png")
        mask = Image.frombytes("P", (args.size, args.size), mask.tobytes())
        mask.putpalette(palette)
        mask.save(out / "masks" / f"digit_{i:04d}.png")
    print(f"wrote {args.count} images of {args.size}x{args.size} and their masks to {out}/")


if __name__ == "__main__":
    main()
