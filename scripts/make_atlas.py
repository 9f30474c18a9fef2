"""Write an atlas-like segmentation set for recipes/unet.py: many regions told apart by where they
lie, in left/right twins, as a brain atlas labels MRI slices.

    python scripts/make_atlas.py                        # 240 images of 96x96, 120 regions
    python scripts/make_atlas.py --out /tmp/atlas --count 40 --regions 30 --size 64

A template holds an elliptic "brain" cut into --regions regions: seed points in its left half,
each mirrored into the right half (a left region and its right twin, classes 2k+1 and 2k+2), and
a few on the midline, each pixel the region of its nearest seed (Voronoi cells). Each image warps
the template by its own random affine (scale, rotation, shift) and a smooth random displacement,
so region boundaries move and bend from image to image. The image is a grey slice: a bright
skull ring around the brain, and inside it a few tissue intensities (a region takes one of 3, so
most region boundaries cannot be seen), a smooth bias field and noise. Only position tells the
regions apart, relative to the brain's outline and its visible tissue borders: what the U-Net has
to learn on a real atlas. A horizontal flip of a mask puts each left region where its right twin
is: the case that `--hflip` must not be used on (docs/unet.md, "Flips that change a class").

The layout is imgs/atlas_0000.png (grey) and masks/atlas_0000.png (16-bit grey levels: 0 outside
the brain, 1..regions the regions). Image i depends only on (--seed, i) and the settings.
"""

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def template_seeds(regions, rng):
    """Seed points (x, y) in the unit disc, and their region values: pairs mirrored across x = 0
    (left, then its right twin), and the rest on the midline."""
    midline = min(regions, 2 + regions % 2)
    pairs = (regions - midline) // 2
    spacing = 0.75 * np.sqrt(np.pi / regions)  # cells of similar sizes: none a sliver
    points, values = [], []
    while len(points) < 2 * pairs:
        x, y = rng.uniform(-1, 0), rng.uniform(-1, 1)
        far = all((x - px) ** 2 + (y - py) ** 2 >= spacing**2 for px, py in points)
        if x * x + y * y < 0.9 and x < -spacing / 2 and far:
            value = len(points) + 1
            points += [(x, y), (-x, y)]
            values += [value, value + 1]
    for k in range(midline):
        points.append((0.0, -0.9 + 1.8 * (k + 0.5) / midline))
        values.append(2 * pairs + k + 1)
    return np.array(points), np.array(values)


def smooth_field(rng, size, strength, cells=4):
    """A smooth random field [size, size]: noise on a coarse grid, upsampled bilinearly."""
    coarse = rng.normal(0, strength, (cells, cells)).astype(np.float32)
    return np.asarray(Image.fromarray(coarse, mode="F").resize((size, size), Image.BILINEAR))


def make_pair(i, seeds, values, *, size, seed):
    """Image i: (uint8 grey [size, size], uint16 mask [size, size])."""
    rng = np.random.default_rng((seed, i))
    yy, xx = (np.mgrid[:size, :size] + 0.5) / size * 2 - 1  # -1..1
    scale = rng.uniform(0.85, 1.05)
    angle = np.deg2rad(rng.uniform(-10, 10))
    shift = rng.uniform(-0.06, 0.06, 2)
    x, y = xx - shift[0], yy - shift[1]
    x, y = np.cos(angle) * x + np.sin(angle) * y, -np.sin(angle) * x + np.cos(angle) * y
    axes = np.array([0.72, 0.88]) * scale  # the brain's half-width and half-height
    x = x / axes[0] + smooth_field(rng, size, 0.06)
    y = y / axes[1] + smooth_field(rng, size, 0.06)
    r2 = x * x + y * y
    inside = r2 <= 1
    nearest = np.argmin(
        (x[..., None] - seeds[:, 0]) ** 2 + (y[..., None] - seeds[:, 1]) ** 2, axis=-1
    )
    mask = np.where(inside, values[nearest], 0).astype(np.uint16)
    tissue = np.array([95.0, 140.0, 185.0])[(values - 1) // 2 % 3]  # twins alike, of 3 levels
    image = np.where(inside, tissue[nearest], 20.0)
    image = np.where((r2 > 1.02) & (r2 < 1.25), 230.0, image)  # the skull
    image = image * (1 + smooth_field(rng, size, 0.08)) + rng.normal(0, 12, (size, size))
    return np.clip(image, 0, 255).astype(np.uint8), mask


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="data/atlas", help="folder to write imgs/ and masks/ into")
    p.add_argument("--count", type=int, default=240, help="number of images")
    p.add_argument("--size", type=int, default=96, help="height and width in pixels")
    p.add_argument("--regions", type=int, default=120, help="regions (classes but background)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    seeds, values = template_seeds(args.regions, np.random.default_rng(args.seed + 1000))
    out = Path(args.out)
    (out / "imgs").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(parents=True, exist_ok=True)
    for i in range(args.count):
        image, mask = make_pair(i, seeds, values, size=args.size, seed=args.seed)
        Image.fromarray(image).save(out / "imgs" / f"atlas_{i:04d}.png")
        Image.fromarray(mask).save(out / "masks" / f"atlas_{i:04d}.png")
    pairs = (args.regions - min(args.regions, 2 + args.regions % 2)) // 2
    print(
        f"wrote {args.count} images of {args.size}x{args.size} with {args.regions} regions "
        f"({pairs} left/right pairs) to {out}/"
    )


if __name__ == "__main__":
    main()
