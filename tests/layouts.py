"""The test shapes (conftest's `shapes`) saved in the layouts that segmentation users bring, each
exactly as the public dataset lays out its files, masks and splits:

    voc_layout(shapes, root)      Pascal VOC: JPEGImages/, SegmentationClass/ palette PNGs, lists
    pet_layout(shapes, root)      Oxford-IIIT Pet: images/, annotations/trimaps/ (1 pet, 2 back-
                                  ground, 3 border), annotations/trainval.txt and test.txt
    isic_layout(shapes, root)     ISIC 2018: *_Input/ISIC_x.jpg with
                                  *_GroundTruth/ISIC_x_segmentation.png
    camvid_layout(shapes, root)   CamVid: train/, train_labels/NAME_L.png colours, val/, test/,
                                  class_dict.csv (name,r,g,b)
    carvana_layout(shapes, root)  Kaggle's Carvana: train/NAME.jpg, train_masks/NAME_mask.gif

split_names(shapes): the last 10 images validate, the others train. flags_of(error): the
settings that the first error on such a folder names.
"""

import shlex

import numpy as np
from conftest import with_void
from PIL import Image


def flags_of(error):
    """The settings that an error's "read it with ..." names."""
    return shlex.split(str(error).split("read it with ")[1])


def split_names(shapes):
    """The shapes' names: the last 10 validate, the others train."""
    names = sorted(p.stem for p in (shapes / "imgs").glob("*.png"))
    return {"train": names[:-10], "val": names[-10:]}


def image_and_mask(shapes, name):
    image = Image.open(shapes / "imgs" / f"{name}.png").convert("RGB")
    return image, np.asarray(Image.open(shapes / "masks" / f"{name}_mask.png"))


def band(values, width=1):
    """Pixels within `width` of an edge between two values: a band 2 x width + 1 wide."""
    edge = np.zeros(values.shape, bool)
    edge[:-1] |= values[:-1] != values[1:]
    edge[:, :-1] |= values[:, :-1] != values[:, 1:]
    for _ in range(width):
        for axis in (0, 1):
            edge |= np.roll(edge, 1, axis) | np.roll(edge, -1, axis)
    return edge


def voc_layout(shapes, root, extra=0):
    """`shapes` in Pascal VOC's layout: JPEG images, palette PNG masks holding class indices
    (0..3) and void (255) along the edges, and the splits' names in
    ImageSets/Segmentation/{train,val}.txt. extra: that many more JPEGs without masks, as VOC's
    JPEGImages/ holds (its detection images), with ImageSets/Main/val.txt listing them."""
    for folder in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        (root / folder).mkdir(parents=True)
    palette = [0, 0, 0, 128, 0, 0, 0, 128, 0, 128, 128, 0] + [0] * (256 - 4) * 3
    for split, names in split_names(shapes).items():
        for name in names:
            image, values = image_and_mask(shapes, name)
            image.save(root / "JPEGImages" / f"{name}.jpg", quality=95)
            mask = Image.fromarray(with_void(values, 0), mode="P")
            mask.putpalette(palette)
            mask.save(root / "SegmentationClass" / f"{name}.png")
        (root / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(names) + "\n")
    if extra:
        (root / "ImageSets" / "Main").mkdir()
        names = [f"2008_{i:06d}" for i in range(extra)]
        for name in names:
            image.save(root / "JPEGImages" / f"{name}.jpg")
        (root / "ImageSets" / "Main" / "val.txt").write_text("\n".join(names) + "\n")
    return root


def pet_layout(shapes, root):
    """`shapes` in the Oxford-IIIT Pet's layout: images/Breed_N.jpg, trimaps in
    annotations/trimaps/Breed_N.png holding 1 (the pet: any shape), 2 (background) and 3 (the
    unclassified border, 3 pixels wide), the splits in annotations/trainval.txt and test.txt
    (`NAME class species breed` a line), and annotations/xmls/ (no images)."""
    for folder in ("images", "annotations/trimaps", "annotations/xmls"):
        (root / folder).mkdir(parents=True)
    lines = {}
    for split, names in split_names(shapes).items():
        for i, name in enumerate(names):
            image, values = image_and_mask(shapes, name)
            pet = f"{'Abyssinian' if i % 2 else 'beagle'}_{name.split('_')[-1]}"
            image.save(root / "images" / f"{pet}.jpg", quality=95)
            trimap = np.where(values > 0, 1, 2).astype(np.uint8)
            trimap[band(values > 0)] = 3
            Image.fromarray(trimap).save(root / "annotations" / "trimaps" / f"{pet}.png")
            (root / "annotations" / "xmls" / f"{pet}.xml").write_text("<annotation/>")
            lines.setdefault(split, []).append(f"{pet} {1 + i % 2} {1 + i % 2} 1")
    (root / "annotations" / "trainval.txt").write_text("\n".join(lines["train"]) + "\n")
    (root / "annotations" / "test.txt").write_text("\n".join(lines["val"]) + "\n")
    return root


ISIC_TRAIN = ("ISIC2018_Task1-2_Training_Input", "ISIC2018_Task1_Training_GroundTruth")
ISIC_VAL = ("ISIC2018_Task1-2_Validation_Input", "ISIC2018_Task1_Validation_GroundTruth")


def isic_layout(shapes, root):
    """`shapes` in ISIC 2018's layout (task 1): ISIC_NNNNNNN.jpg in the input folders, with
    ATTRIBUTION.txt and LICENSE.txt beside them, and ISIC_NNNNNNN_segmentation.png (0, and 255
    for the lesion: any shape) in the ground truth folders, for training and validation."""
    for split, (inputs, truth) in (("train", ISIC_TRAIN), ("val", ISIC_VAL)):
        (root / inputs).mkdir(parents=True)
        (root / truth).mkdir(parents=True)
        (root / inputs / "ATTRIBUTION.txt").write_text("by whom")
        (root / inputs / "LICENSE.txt").write_text("CC-BY-NC")
        for name in split_names(shapes)[split]:
            image, values = image_and_mask(shapes, name)
            isic = f"ISIC_{int(name.split('_')[-1]):07d}"
            image.save(root / inputs / f"{isic}.jpg", quality=95)
            lesion = np.where(values > 0, 255, 0).astype(np.uint8)
            Image.fromarray(lesion).save(root / truth / f"{isic}_segmentation.png")
    return root


# CamVid's class_dict.csv: a colour per class; Void (black) along the top of every mask here, and
# Animal in none of the masks, as some of CamVid's 32 classes are in few.
CAMVID_CLASSES = {
    "Animal": (64, 128, 64),
    "Building": (128, 0, 0),
    "Car": (64, 0, 128),
    "Pole": (192, 192, 128),
    "Sky": (128, 128, 128),
    "Void": (0, 0, 0),
}
CAMVID_OF_VALUE = {0: "Sky", 85: "Building", 170: "Car", 255: "Pole"}


def camvid_layout(shapes, root):
    """`shapes` in CamVid's layout (as Kaggle and most U-Net tutorials ship it): train/, val/
    and test/ images NAME.png, their RGB masks train_labels/NAME_L.png (and val_, test_),
    coloured as class_dict.csv (name,r,g,b) says."""
    lut = np.zeros((256, 3), np.uint8)
    for value, name in CAMVID_OF_VALUE.items():
        lut[value] = CAMVID_CLASSES[name]
    names = split_names(shapes)
    for split, part in (("train", names["train"][:-5]), ("val", names["val"])):
        for folder in (split, f"{split}_labels"):
            (root / folder).mkdir(parents=True)
        for name in part:
            image, values = image_and_mask(shapes, name)
            image.save(root / split / f"{name}.png")
            colours = lut[values]
            colours[:2] = CAMVID_CLASSES["Void"]
            Image.fromarray(colours).save(root / f"{split}_labels" / f"{name}_L.png")
    (root / "test").mkdir()
    (root / "test_labels").mkdir()
    for name in names["train"][-5:]:
        image, _ = image_and_mask(shapes, name)
        image.save(root / "test" / f"{name}.png")
        Image.open(root / "train_labels" / f"{names['train'][0]}_L.png").save(
            root / "test_labels" / f"{name}_L.png"
        )
    rows = ["name,r,g,b"] + [f"{n},{r},{g},{b}" for n, (r, g, b) in CAMVID_CLASSES.items()]
    (root / "class_dict.csv").write_text("\n".join(rows) + "\n")
    return root


def carvana_layout(shapes, root):
    """`shapes` in Kaggle's Carvana layout: train/ID_NN.jpg with train_masks/ID_NN_mask.gif
    (0, and 1 for the car: any shape), and test/ images without masks."""
    for folder in ("train", "train_masks", "test"):
        (root / folder).mkdir(parents=True)
    names = sorted(p.stem for p in (shapes / "imgs").glob("*.png"))
    for i, name in enumerate(names):
        image, values = image_and_mask(shapes, name)
        car = f"0cdf5b5d0ce1_{i + 1:02d}"
        image.save(root / "train" / f"{car}.jpg", quality=95)
        Image.fromarray((values > 0).astype(np.uint8)).save(
            root / "train_masks" / f"{car}_mask.gif"
        )
    image.save(root / "test" / "00087a6bd4dc_01.jpg", quality=95)
    return root
