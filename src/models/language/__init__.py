"""Language models.

The Qwen family (`qwen/`), the LightningModule that trains it, LoRA adapters and FSDP2 sharding.
"""
