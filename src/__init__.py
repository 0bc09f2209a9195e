"""PyTorch training template: Lightning modules, datamodules and callbacks built from configs."""
