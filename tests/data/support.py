"""What the chat-template and preference-data tests share: a tokenizer folder with a template."""

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer_folder(
    folder: Path, template: str | None, in_config: bool = False, eos_token: str = "<|im_end|>"
) -> Path:
    """A byte-level BPE (with merges, so pieces tokenise as words) saved by transformers, with
    `template` in chat_template.jinja or, `in_config`, in tokenizer_config.json."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    words = "user assistant system Name a colour Blue Red green Another brief think"
    tokenizer.train_from_iterator([words] * 20, trainer=trainer)
    tokenizer.add_tokens(["<think>", "</think>"])  # added, not special, as in Qwen3
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos_token).save_pretrained(folder)
    if template is not None and in_config:
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return folder
