"""Export a trained language model as a transformers folder that `from_pretrained` loads.

The folder (config.json, model.safetensors and the run's own tokenizer) loads as it is, as
lm-eval's `hf` wrapper loads it.

Checkpoints carry their tokenizer, and it is written here as the `tokenizer.json` that
`AutoTokenizer` reads, the byte tokenizer included (as a byte-level BPE without merges, which
gives each byte its own value as id). A run with LoRA adapters (`adapter=lora`) is exported
here with the adapters merged into its weights, so that what transformers loads is one plain
model; `export_peft` writes its adapters alone, as the folder peft loads onto the base.
"""

from pathlib import Path

import tokenizers
from lightning.pytorch import LightningModule
from tokenizers import decoders, models, pre_tokenizers

from src.data.corpus.tokenizers import END_OF_TEXT, ByteTokenizer, FileTokenizer
from src.models.language.language_model import LanguageModel
from src.utils.contracts import Tokenizer
from src.utils.errors import CheckpointError


def export_for_transformers(
    model: LightningModule, tokenizer: Tokenizer | None, folder: Path
) -> None:
    """Write `model` (a LanguageModel) and `tokenizer` into `folder` in transformers' format.

    `tokenizer` is None only for a run on images (`Restored.tokenizer`), whose model is refused.
    """
    if not isinstance(model, LanguageModel):
        raise CheckpointError(
            f"The checkpoint holds a {type(model).__name__}, not a language model, so it has no "
            f"transformers form: use a run of a Qwen model config (e.g. model=qwen3_tiny)."
        )
    assert tokenizer is not None  # a language model's run reads tokenized text
    model.adapter.merged_network().save_pretrained(folder)
    if isinstance(tokenizer, ByteTokenizer):
        tokenizer = FileTokenizer(byte_level_bpe(), END_OF_TEXT)
    tokenizer.save(folder)


def export_peft(model: LightningModule, folder: Path) -> None:
    """Write a LoRA run's adapters as adapter_config.json and adapter_model.safetensors.

    `peft.PeftModel.from_pretrained` loads them onto transformers' model of the base folder, and
    `adapter.path=<folder>` trains on from them.
    """
    if not isinstance(model, LanguageModel):
        raise CheckpointError(
            f"format=peft writes LoRA adapters, and this checkpoint ({type(model).__name__}) "
            f"has none: it is a run without adapter=lora. Export it with format=merged (a "
            f"transformers folder) or format=safetensors."
        )
    model.adapter.save_peft(folder)  # refused, naming the other formats, without LoRA


def byte_level_bpe() -> tokenizers.Tokenizer:
    """Build a `tokenizers.Tokenizer` that encodes text as ByteTokenizer does.

    Each UTF-8 byte is the token of its own value, and END_OF_TEXT is 256.
    """
    alphabet = byte_level_alphabet()
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[])
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([END_OF_TEXT])
    return tokenizer


def byte_level_alphabet() -> dict[int, str]:
    """Map each byte to the character that byte-level BPE stands it for.

    As GPT-2's `pre_tokenizers.ByteLevel` does: printable bytes stand for themselves, the others
    for the characters from 256 on.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    return {b: chr(b) for b in printable} | {b: chr(256 + i) for i, b in enumerate(others)}
