"""The models `ddpkit train` offers: an MLP and a small CNN."""

from __future__ import annotations

from torch import nn


def mlp(num_features: int, num_classes: int, hidden: int = 256, depth: int = 2) -> nn.Module:
    """`depth` hidden layers of `hidden` units with ReLU; flattens image inputs."""
    layers: list[nn.Module] = [nn.Flatten()]
    width = num_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def small_cnn(image_shape: tuple[int, int, int], num_classes: int, channels: int = 32) -> nn.Module:
    """Two 3x3 convolutions (the second strided), global average pooling and a linear classifier."""
    in_channels = image_shape[0]
    return nn.Sequential(
        nn.Conv2d(in_channels, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(2 * channels, num_classes),
    )
