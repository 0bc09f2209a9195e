"""Networks and the LightningModules that train them.

`vision/` holds the image classifiers, `language/` the Qwen family with LoRA and sharding; the
optimizer contract they share sits here.
"""
