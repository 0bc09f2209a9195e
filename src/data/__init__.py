"""Datamodules: embedded digits, torchvision MNIST-style sets, image folders and in-memory tensors."""
