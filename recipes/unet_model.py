"""The classic U-Net of Ronneberger et al., as in milesial/Pytorch-UNet: 4 levels down, 4 up, a
skip connection at each level. recipes/unet.py builds it from its Config; replace it there."""

import torch
import torch.nn as nn
import torch.nn.functional as F

# The U-Net halves an image 4 times on its way down: an input side that is a multiple of 2**4
# comes back up at its own size, so padded batches and predict's tiles keep to this grid.
PAD_MULTIPLE = 16
MIN_SIZE = 32  # the smallest input side that training, crops and tiles accept


def double_conv(cin, cout, mid=None):
    mid = mid or cout
    return nn.Sequential(
        nn.Conv2d(cin, mid, 3, padding=1, bias=False),
        nn.BatchNorm2d(mid),
        nn.ReLU(inplace=True),
        nn.Conv2d(mid, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
    )


class Up(nn.Module):
    def __init__(self, cin, cout, bilinear):
        super().__init__()
        if bilinear:  # no weights in the upsampling: the convolutions halve the channels instead
            self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
            self.conv = double_conv(cin, cout, cin // 2)
        else:
            self.up = nn.ConvTranspose2d(cin, cin // 2, 2, stride=2)
            self.conv = double_conv(cin, cout)

    def forward(self, x, skip):
        x = self.up(x)
        # An odd size lost a pixel going down: pad back to the skip's size.
        dy, dx = skip.shape[2] - x.shape[2], skip.shape[3] - x.shape[3]
        x = F.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], 1))


class UNet(nn.Module):
    def __init__(self, num_classes, base_channels=64, bilinear=False, in_channels=3):
        super().__init__()
        c = [base_channels * 2**i for i in range(5)]  # 64, 128, 256, 512, 1024
        f = 2 if bilinear else 1
        self.inc = double_conv(in_channels, c[0])
        self.downs = nn.ModuleList(
            nn.Sequential(nn.MaxPool2d(2), double_conv(c[i], c[i + 1] // (f if i == 3 else 1)))
            for i in range(4)
        )
        self.ups = nn.ModuleList(
            Up(c[i], c[i - 1] // (f if i > 1 else 1), bilinear) for i in (4, 3, 2, 1)
        )
        self.outc = nn.Conv2d(c[0], num_classes, 1)

    def forward(self, x):
        skips = [self.inc(x)]
        for down in self.downs:
            skips.append(down(skips[-1]))
        x = skips.pop()
        for up in self.ups:
            x = up(x, skips.pop())
        return self.outc(x)  # logits [N, num_classes, H, W]
