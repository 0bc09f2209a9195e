"""Image classification datamodules.

Embedded digits, torchvision MNIST-style sets, image folders and users' own tensors, all on the
transforms, splits and loaders of `datamodule.py`.
"""
