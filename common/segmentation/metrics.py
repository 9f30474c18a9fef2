"""The scores of segmentation: confusion counts per image, and IoU and Dice per class from their
sum over the whole split, as the public tables compute mIoU.

    counts = confusion_counts(logits, target, num_classes)  # per image; gather, then sum
    iou, dice = class_scores(counts.sum(0), classes)        # per class, None where absent
"""

import torch

from common.segmentation.inference import predicted_classes


def confusion_counts(logits, target, num_classes):
    """Per image, the pixels of each (true class, predicted class) pair, of hard predictions:
    int64 [N, C * C], C the classes told apart (2 for one sigmoid output). Pixels whose target
    is negative (ignored, padded) are in none. Per image, so that gather_for_metrics can drop a
    prepared loader's padded duplicates; summed over the whole split and every process, it is
    the confusion matrix that the public tables' mIoU comes from."""
    classes = 2 if num_classes == 1 else num_classes
    pred = predicted_classes(logits, num_classes)
    n = len(pred)
    image = torch.arange(n, device=pred.device).view(n, 1, 1)
    index = (image * classes + target.clamp(min=0)) * classes + pred
    counts = torch.bincount(index[target >= 0], minlength=n * classes * classes)
    return counts.view(n, classes * classes)


def class_scores(confusion, classes):
    """(IoU, Dice) of each class from a confusion matrix (confusion_counts summed), as lists:
    TP / (TP + FP + FN) and 2 TP / (2 TP + FP + FN), None for a class absent from both the
    masks and the predictions, which the mean over classes (mIoU) leaves out, as torchvision's
    and mmsegmentation's evaluations do."""
    matrix = torch.as_tensor(confusion).reshape(classes, classes).double().cpu()
    hits = matrix.diagonal()
    union = matrix.sum(0) + matrix.sum(1) - hits
    iou = [None if u == 0 else (t / u).item() for t, u in zip(hits, union)]
    dice = [None if u == 0 else (2 * t / (u + t)).item() for t, u in zip(hits, union)]
    return iou, dice
