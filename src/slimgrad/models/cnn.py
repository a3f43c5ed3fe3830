"""ResNet- and VGG-like CNNs with the layer structure of torchvision's, at any width.

They use the modules slimgrad converts (conv, batch norm, in-place ReLU, max/avg/adaptive pooling,
dropout) the way torchvision's models do, including residual additions and downsampling shortcuts, so
that converting them exercises the same data flow a user's model has.
"""

from __future__ import annotations

from torch import nn


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(cin, cout, kernel, stride, kernel // 2, bias=False), nn.BatchNorm2d(cout)]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 3, stride)
        self.relu = nn.ReLU(inplace=True)
        self.conv2, self.bn2 = _conv_bn(width, cout, 3)
        self.downsample = (
            nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
        )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1):
        super().__init__()
        cout = width * self.expansion
        self.conv1, self.bn1 = _conv_bn(cin, width, 1)
        self.conv2, self.bn2 = _conv_bn(width, width, 3, stride)
        self.conv3, self.bn3 = _conv_bn(width, cout, 1)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = (
            nn.Sequential(*_conv_bn(cin, cout, 1, stride)) if stride != 1 or cin != cout else None
        )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision-style ResNet: 7×7/2 stem, 3×3/2 max pool, four stages, global average pool, fc."""

    def __init__(self, block: type, layers: list[int], num_classes: int = 1000, base_width: int = 64,
                 in_channels: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, base_width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(base_width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        cin = base_width
        stages = []
        for i, blocks in enumerate(layers):
            width = base_width * 2**i
            stage = []
            for j in range(blocks):
                stage.append(block(cin, width, stride=2 if (i > 0 and j == 0) else 1))
                cin = width * block.expansion
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


class VGG(nn.Module):
    """VGG-11-like with batch norm: conv-BN-ReLU stacks, max pools, a dropout classifier head."""

    CONFIG_11 = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]

    def __init__(self, config=None, num_classes: int = 1000, width_scale: float = 1.0, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = []
        cin = in_channels
        for item in config or self.CONFIG_11:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
            else:
                cout = max(1, int(item * width_scale))
                layers += [*_conv_bn(cin, cout, 3), nn.ReLU(inplace=True)]
                cin = cout
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        hidden = max(8, int(4096 * width_scale))
        self.classifier = nn.Sequential(
            nn.Linear(cin * 49, hidden), nn.ReLU(True), nn.Dropout(),
            nn.Linear(hidden, hidden), nn.ReLU(True), nn.Dropout(),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)).flatten(1))


def resnet18(**kw) -> ResNet:
    return ResNet(BasicBlock, [2, 2, 2, 2], **kw)


def resnet50(**kw) -> ResNet:
    return ResNet(Bottleneck, [3, 4, 6, 3], **kw)


def vgg11(**kw) -> VGG:
    return VGG(**kw)


#: name -> factory; every factory takes ``num_classes`` and a width argument
MODELS = {"resnet18": resnet18, "resnet50": resnet50, "vgg11": vgg11}


def build_model(name: str, **kwargs) -> nn.Module:
    """Build an in-repo model by name; unknown names get an error listing the known ones."""
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None
    return factory(**kwargs)
