"""What the U-Net measures and what it optimises: mIoU and the per-class IoU and Dice from one
confusion matrix, class weights and the focal loss for imbalanced classes, and the start-up note
when one class holds most pixels. In-process; the exactness of the confusion matrix on 2
processes (each pixel once) is checked by the launches of test_unet_training.py."""

import math
import re

import numpy as np
import pytest
import torch
from conftest import REPO, VAL_FRACTION, relabelled

import unet_rules
from common.config import UserError, parse_config
from common.segmentation.data import IGNORE
from common.segmentation.metrics import class_scores, confusion_counts


def test_miou_comes_from_one_confusion_matrix_and_leaves_absent_classes_out():
    # 2 images of 2x3 pixels, 4 classes: class 3 is neither in the masks nor predicted.
    target = torch.tensor([[[0, 0, 1], [1, 2, -1]], [[0, 2, 2], [-1, -1, 0]]])
    pred = torch.tensor([[[0, 1, 1], [1, 2, 3]], [[0, 0, 2], [1, 1, 0]]])
    logits = torch.nn.functional.one_hot(pred, 4).permute(0, 3, 1, 2).float()
    counts = confusion_counts(logits, target, 4)
    assert counts.shape == (2, 16) and counts.sum() == (target >= 0).sum() == 9
    matrix = counts.sum(0).view(4, 4)  # [true, predicted]
    assert matrix[0].tolist() == [3, 1, 0, 0] and matrix[1].tolist() == [0, 2, 0, 0]
    assert matrix[2].tolist() == [1, 0, 2, 0]
    iou, dice = class_scores(counts.sum(0), 4)
    # class 0: 3 right, 1 missed, 1 too many; class 1: 2 right, 1 too many; class 2: 2 right, 1
    # missed; class 3: in neither, so None, and not in the mean.
    assert iou[:3] == pytest.approx([3 / 5, 2 / 3, 2 / 3]) and iou[3] is None
    assert dice[:3] == pytest.approx([6 / 8, 4 / 5, 4 / 5]) and dice[3] is None
    # One sigmoid output tells two classes apart, as one with two.
    sigmoid = torch.where(pred > 0, 5.0, -5.0)[:, None]
    assert confusion_counts(sigmoid, target.clamp(max=1), 1).sum(0).view(2, 2).sum() == 9


def test_class_weights_and_the_focal_loss(unet):
    cfg = unet.Config(num_classes=3, class_weights="auto")
    pixels = [900, 90, 10]
    weights = unet_rules.class_weights(cfg, pixels, "cpu")
    share = torch.tensor(pixels) / 1000
    assert weights[0] < weights[1] < weights[2] <= 50 * weights[0]  # rare classes weigh more
    assert (weights * share).sum().item() == pytest.approx(1)  # the average pixel weighs 1
    assert (
        unet_rules.class_weights(unet.Config(num_classes=3), pixels, "cpu") is None
    )  # off by default
    listed = unet_rules.class_weights(
        unet.Config(num_classes=3, class_weights="0.5,1,2"), pixels, "cpu"
    )
    assert listed.tolist() == [0.5, 1, 2]
    with pytest.raises(UserError, match=re.escape("class_weights lists 2 weights for 3 classes")):
        unet_rules.class_weights(unet.Config(num_classes=3, class_weights="1,2"), pixels, "cpu")
    # The weights scale each pixel's cross-entropy by its true class's weight.
    torch.manual_seed(0)
    logits, target = torch.randn(1, 3, 4, 4), torch.randint(0, 3, (1, 4, 4))
    dice_part = unet.loss_per_image(torch.zeros(1, 3, 4, 4), target, num_classes=3)
    plain = unet.loss_per_image(logits, target, num_classes=3)
    doubled = unet.loss_per_image(logits, target, num_classes=3, weights=torch.full((3,), 2.0))
    ce = torch.nn.functional.cross_entropy(logits, target)
    assert (doubled - plain).item() == pytest.approx(ce.item(), rel=1e-5)
    assert dice_part.item() > 0
    # focal_gamma 0 is the cross-entropy; above 0, a pixel already right counts far less, one
    # that is wrong nearly as much.
    right, wrong = torch.tensor([[[[4.0]], [[0.0]]]]), torch.tensor([[[[0.0]], [[4.0]]]])
    zero = torch.zeros(1, 1, 1, dtype=torch.long)
    for logits in (right, wrong):
        assert unet.loss_per_image(logits, zero, num_classes=2, focal_gamma=0.0) == pytest.approx(
            unet.loss_per_image(logits, zero, num_classes=2).item()
        )
    ce_right, ce_wrong = (math.log(1 + math.exp(d)) for d in (-4, 4))
    for logits, ce in ((right, ce_right), (wrong, ce_wrong)):
        focal = unet.loss_per_image(logits, zero, num_classes=2, focal_gamma=2.0)
        plain = unet.loss_per_image(logits, zero, num_classes=2)
        assert (plain - focal).item() == pytest.approx(
            ce * (1 - (1 - math.exp(-ce)) ** 2), rel=1e-3
        )
    assert (1 - math.exp(-ce_right)) ** 2 < 1e-3 < 0.9 < (1 - math.exp(-ce_wrong)) ** 2


def test_the_dice_term_takes_only_the_classes_in_each_mask_and_dice_weight_scales_it(unet):
    # Image 0 holds classes 0 and 1 (and ignored pixels), image 1 class 2 alone, image 2 nothing
    # but ignored pixels; 4 classes, so class 3 is in no mask.
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 5, 6)
    target = torch.zeros(3, 5, 6, dtype=torch.long)
    target[0, 2:] = 1
    target[0, 0, :2] = target[2] = IGNORE
    target[1] = 2
    valid = (target != IGNORE).float()
    p, t = logits.softmax(1), torch.nn.functional.one_hot(target.clamp(min=0), 4)
    p, t = p * valid[:, None], t.permute(0, 3, 1, 2) * valid[:, None]
    dice = (2 * (p * t).sum((2, 3)) + 1) / ((p + t).sum((2, 3)) + 1)
    ce = torch.nn.functional.cross_entropy(logits, target, ignore_index=IGNORE, reduction="none")
    ce = ce.sum((1, 2)) / valid.sum((1, 2)).clamp(min=1)
    # The Dice loss of each image is the mean over the classes in its mask, not over all 4: a
    # class absent from a mask gets no term that pushes its probability down there.
    dice_loss = torch.stack([1 - dice[0, :2].mean(), 1 - dice[1, 2], torch.tensor(0.0)])
    for weight in (1.0, 0.5, 0.0):
        loss = unet.loss_per_image(logits, target, num_classes=4, dice_weight=weight)
        assert torch.allclose(loss, ce + weight * dice_loss, atol=1e-6), weight
    assert unet.loss_per_image(logits, target, num_classes=4)[2] == 0  # nothing to learn from
    # One sigmoid output: the Dice of the foreground, where the mask holds any.
    fg = torch.randn(2, 1, 5, 6)
    binary = torch.zeros(2, 5, 6, dtype=torch.long)
    binary[0, :2] = 1
    q = fg[:, 0].sigmoid()
    bce = torch.nn.functional.binary_cross_entropy_with_logits(
        fg[:, 0], binary.float(), reduction="none"
    )
    fg_dice = (2 * (q * binary)[0].sum() + 1) / ((q + binary)[0].sum() + 1)
    expected = bce.mean((1, 2)) + torch.stack([1 - fg_dice, torch.tensor(0.0)])
    assert torch.allclose(unet.loss_per_image(fg, binary, num_classes=1), expected, atol=1e-6)


@pytest.mark.parametrize("classes", [2, 117])
def test_dice_sums_and_counts_from_the_labels_equal_those_of_a_dense_one_hot(unet, classes):
    # The soft Dice sums of the loss (gathers and scatters over the labels) and the hard Dice
    # counts of evaluate (from each image's confusion matrix) against what a dense one-hot
    # [N, C, H, W] gives, as the recipe computed them before, ignored pixels in none.
    torch.manual_seed(0)
    logits = 3 * torch.randn(4, classes, 9, 7)
    target = torch.randint(0, classes, (4, 9, 7))
    target[0, :3] = IGNORE
    valid = target != IGNORE
    probs = logits.softmax(1)
    onehot = torch.nn.functional.one_hot(target.clamp(min=0), classes).permute(0, 3, 1, 2)
    p, t = probs * valid[:, None], onehot * valid[:, None]
    inter, total, true = unet.soft_dice_sums(probs, target.clamp(min=0), valid)
    assert torch.allclose(inter, (p * t).sum((2, 3)), atol=1e-5)
    assert torch.allclose(total, (p + t).sum((2, 3)), atol=1e-5)
    assert torch.equal(true, t.sum((2, 3)).float())
    pred = torch.where(valid, logits.argmax(1), 0)
    foreground = torch.arange(1, classes)[:, None, None]
    pred, truth = pred[:, None] == foreground, target[:, None] == foreground  # [N, C - 1, H, W]
    hits, sizes = unet.dice_counts(confusion_counts(logits, target, classes), classes)
    assert torch.equal(hits, (pred & truth).sum((2, 3)))
    assert torch.equal(sizes, pred.sum((2, 3)) + truth.sum((2, 3)))


@pytest.mark.slow
def test_the_imbalance_note_names_the_setting_when_one_class_holds_most_pixels(
    unet, shapes, tmp_path
):
    from common.accelerator import build_accelerator

    # Only the triangles are objects: 3% of the pixels, the background the rest.
    root = relabelled(
        shapes, tmp_path / "few", lambda v, i: np.where(v == 255, 1, 0).astype(np.uint8)
    )
    args = ["--dataset", root, "--val_fraction", VAL_FRACTION, "--num_workers", 0]
    cfg = parse_config(unet.Config, [str(a) for a in args])
    data = unet.load_data(cfg, build_accelerator())
    note = unet_rules.imbalance_note(cfg, data)
    assert (
        note.startswith("note: class 0 (mask value 0) holds 9") and "of the training pixels" in note
    )
    # For a run that ends so: shape-coded classes leave the background alone after some epochs.
    assert "if a run ends with the model predicting it alone (its IoU near 0.9" in note
    assert note.endswith(
        "set --class_weights auto, or --config recipes/configs/rare_classes.yaml; "
        "--overfit_batches 1 checks that it can learn one batch"
    )
    # The preset it names is one that sets the class weights, so that the note says no more.
    preset = ["--config", str(REPO / unet_rules.RARE_CLASSES)]
    for setting in (["--class_weights", "auto"], ["--focal_gamma", "2"], preset):
        assert (
            unet_rules.imbalance_note(parse_config(unet.Config, [*map(str, args), *setting]), data)
            is None
        )


@pytest.mark.slow
def test_the_imbalance_notes_miou_is_what_a_model_of_the_dominant_class_alone_scores(unet):
    # 95% background, 5% class 1, classes 2 and 3 in no mask (CamVid's Sky, where the issue's
    # model predicted Building alone): such a model scores IoU 0.95 and 0, the absent classes
    # left out of the mean: miou 0.475, not 1 / 4.
    from types import SimpleNamespace

    from common.segmentation.data import MaskClasses

    pixels = [95, 5, 0, 0]
    data = SimpleNamespace(
        class_pixels=pixels,
        values=[0, 1, 2, 3],
        names=["0", "1", "2", "3"],
        classes=MaskClasses(values=(0, 1, 2, 3)),
    )
    note = unet_rules.imbalance_note(parse_config(unet.Config, []), data)
    matrix = torch.zeros(4, 4)  # [true, predicted]: every pixel predicted as class 0
    matrix[:, 0] = torch.tensor(pixels, dtype=torch.float)
    iou, _ = class_scores(matrix.flatten(), 4)
    scored = [v for v in iou if v is not None]
    assert iou == [0.95, 0.0, None, None] and sum(scored) / len(scored) == 0.475
    assert "(its IoU near 0.95, the other classes' 0: miou near 0.47)" in note, note
