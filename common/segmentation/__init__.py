"""What the U-Net recipe alone uses: image and mask pairs, their decoding, augmentation and
batches (data, pairs, augment), inference in tiles and flips, confusion counts, the panels that
draw the classes, and gradient checkpointing. A copy of another recipe carries none of it."""
