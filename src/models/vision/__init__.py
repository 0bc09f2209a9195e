"""Image classifiers.

SimpleNet, the CNN, torchvision backbones, and the LightningModule that trains any of them.
"""
