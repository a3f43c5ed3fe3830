"""Small models written in-repo (no torchvision CPU build exists) for the demo, tests and benchmarks."""

from .cnn import MODELS, VGG, ResNet, build_model

__all__ = ["MODELS", "ResNet", "VGG", "build_model"]
