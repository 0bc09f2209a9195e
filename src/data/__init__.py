"""Datamodules: embedded digits, torchvision MNIST-style sets, image folders, in-memory tensors."""
