"""Language-model datamodules.

Pretraining text (stored or streamed), supervised fine-tuning on conversations, byte-level text,
and the chat templates SFT renders with.
"""
