"""The contracts between models, datamodules and callbacks, declared once.

Each is a `typing.Protocol` checked with `isinstance` where it is used: a callback or the run
layer asks "does this datamodule report token accounting?" instead of probing attributes with
`hasattr`. A class fulfils a contract by having the members, without inheriting from it.
"""

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

# The label of a position that is not supervised (padding, prompts, document ends), as in
# torch.nn.functional.cross_entropy's default `ignore_index`.
IGNORE_INDEX = -100

# What a batch holds. A model class declares the kind it trains on and a datamodule class the
# kind it yields, both as `batch_kind`, so that a pair that cannot work together is refused by
# name before anything is built (src/run/config/checks.py).
IMAGES = "labelled images"
TOKENS = "token sequences"

# A held-out prompt (token ids) and the answer expected for it, for exact-match scoring.
ExactMatchExample = tuple[list[int], str]


@runtime_checkable
class Tokenizer(Protocol):
    """What the text datamodules, generation and exact-match scoring need of a tokenizer."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    fingerprint: str  # identifies the vocabulary, for caches

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def save(self, folder: Path) -> None: ...


@runtime_checkable
class CountsFlops(Protocol):
    """A model that knows its training FLOPs per batch (the Throughput callback's MFU)."""

    def flops_per_batch(self, batch: Any) -> Any: ...  # a float, or a 0-d tensor (no sync)


@runtime_checkable
class HasVocabulary(Protocol):
    """A language model or a text datamodule: the token ids it handles are below vocab_size."""

    @property
    def vocab_size(self) -> int: ...


@runtime_checkable
class AnswersPrompts(Protocol):
    """A language model that answers prompts greedily, for exact-match scoring."""

    def count_exact_matches(
        self, tokenizer: Tokenizer, examples: Sequence[ExactMatchExample]
    ) -> int: ...


@runtime_checkable
class TokenizedData(Protocol):
    """A text datamodule: its token ids come from (and decode with) `tokenizer`."""

    tokenizer: Tokenizer


@runtime_checkable
class ExactMatchData(TokenizedData, Protocol):
    """A datamodule with held-out prompts whose answers are known (SFT data)."""

    def exact_match_examples(self, split: str) -> list[ExactMatchExample]: ...


@runtime_checkable
class ReportsTokenAccounting(Protocol):
    """A text datamodule that says what its over-long policy and packing did to the tokens."""

    max_seq_len: int
    accounting: Mapping[str, Any]  # split -> src.data.packing.packing.TokenAccounting

    def packing_metrics(self) -> dict[str, float]: ...


@runtime_checkable
class MixedData(Protocol):
    """A datamodule of several weighted sources (`data.mixture`).

    Its validation and test serve one loader per source, in the order of `source_names`
    (empty without a mixture).
    """

    @property
    def source_names(self) -> tuple[str, ...]: ...


@runtime_checkable
class HasTestConfusionMatrix(Protocol):
    """A classifier whose test loop fills a confusion matrix (rows: true, columns: predicted).

    The matrix is a torchmetrics `MulticlassConfusionMatrix`.
    """

    test_confusion_matrix: Any


@runtime_checkable
class NamesClasses(Protocol):
    """A datamodule that may know the names behind its label indices (None when it does not)."""

    class_names: list[str] | None


@runtime_checkable
class Adapter(Protocol):
    """A language model's adapter (LoRA, QLoRA or none): what trains, is kept and is exported.

    It decides what trains, what its checkpoints keep of the network, and the network's exports
    (merged into plain weights, or as a peft folder).
    """

    # True: only the adapter's own weights train (the base is frozen), and checkpoints name
    # the base instead of holding it, so they load only once `complete_checkpoint` ran.
    freezes_base: bool

    def hyperparameters(self) -> dict[str, Any]: ...  # what rebuilds it from a checkpoint

    def check_can_train(self) -> None: ...  # raises, naming the fix, when it cannot train

    def strip_checkpoint(self, checkpoint: dict[str, Any]) -> None: ...

    def complete_checkpoint(self, checkpoint: dict[str, Any], module: Any) -> None: ...

    def merged_network(self) -> Any: ...  # the network with the adapter folded in

    def save_peft(self, folder: Path) -> None: ...


@runtime_checkable
class HasAdapter(Protocol):
    """A model that trains through an `Adapter` (the language model: LoRA, QLoRA or none)."""

    adapter: Adapter
