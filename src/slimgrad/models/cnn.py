"""ResNet-, VGG- and ConvNeXt-like CNNs and a ViT-like encoder, with torchvision's layer structure.

They use the modules slimgrad converts (conv, batch norm, in-place ReLU, max/avg/adaptive pooling,
dropout) the way torchvision's models do, including residual additions and downsampling shortcuts, so
that converting them exercises the same data flow a user's model has.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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




_DEFAULT_WIDTH = {"resnet18": 64, "resnet50": 64, "convnext": 48, "vit": 192}


def build_model(name: str, *, width_scale: float | None = None, **kwargs) -> nn.Module:
    """Build an in-repo model by name; unknown names get an error listing the known ones.

    ``width_scale`` scales every model's channel widths the same way (1.0: the standard widths).
    """
    try:
        factory = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None
    if width_scale is not None:
        if name in _DEFAULT_WIDTH:
            step = 64 if name == "vit" else 8  # ViT heads are 64 wide
            kwargs["base_width"] = max(step, round(_DEFAULT_WIDTH[name] * width_scale / step) * step)
        else:
            kwargs["width_scale"] = width_scale
    return factory(**kwargs)


class LayerNorm2d(nn.LayerNorm):
    """LayerNorm over channels of an NCHW tensor (ConvNeXt's downsampling norm), via a permute.

    Its forward is written as transformers' ``LayerNorm2d`` is, so that convert replaces it as it replaces theirs
    (registered below; written as ``super().forward`` of the permuted map, convert left it stock and said so)."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        x = x.permute(0, 3, 1, 2)
        return x


class ConvNeXtBlock(nn.Module):
    """Depthwise 7×7 conv, LayerNorm over channels, pointwise MLP with GELU, layer scale, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), 1e-6))

    def forward(self, x):
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.pwconv2(self.act(self.pwconv1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    """A small ConvNeXt-like network: 4×4/4 patchify stem, four stages, global pool, LayerNorm, head."""

    def __init__(self, depths=(2, 2, 6, 2), dims=(48, 96, 192, 384), num_classes: int = 1000, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(in_channels, dims[0], 4, 4), LayerNorm2d(dims[0], eps=1e-6)]
        for i, (depth, dim) in enumerate(zip(depths, dims)):
            if i > 0:
                layers += [LayerNorm2d(dims[i - 1], eps=1e-6), nn.Conv2d(dims[i - 1], dim, 2, 2)]
            layers += [ConvNeXtBlock(dim) for _ in range(depth)]
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.norm = nn.LayerNorm(dims[-1], eps=1e-6)
        self.head = nn.Linear(dims[-1], num_classes)

    def forward(self, x):
        return self.head(self.norm(self.pool(self.features(x)).flatten(1)))


class ViTEncoder(nn.Module):
    """A transformer encoder over image patches (ViT-like): conv patch embedding, nn.TransformerEncoder
    with pre-norm layers and GELU, mean pooling, a linear head."""

    def __init__(self, dim: int = 192, depth: int = 6, heads: int = 3, patch: int = 16, num_classes: int = 1000,
                 in_channels: int = 3):
        super().__init__()
        self.embed = nn.Conv2d(in_channels, dim, patch, patch)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        return self.head(self.norm(self.encoder(tokens)).mean(1))


def convnext(base_width: int = 48, **kw) -> ConvNeXt:
    return ConvNeXt(dims=tuple(base_width * 2**i for i in range(4)), **kw)


def vit(base_width: int = 192, **kw) -> ViTEncoder:
    return ViTEncoder(dim=base_width, heads=max(1, base_width // 64), **kw)


#: name -> factory; every factory takes ``num_classes`` and a width argument (``base_width`` or, for VGG,
#: ``width_scale``)
MODELS = {"resnet18": resnet18, "resnet50": resnet50, "vgg11": vgg11, "convnext": convnext, "vit": vit}


def _register_own_norms() -> None:
    from slimgrad.integrations.hf_layer_norm_2d import register_class

    register_class(LayerNorm2d)


_register_own_norms()
