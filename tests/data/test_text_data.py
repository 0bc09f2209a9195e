"""The text and SFT datamodules: document splits, tokenizers, the token store they read, SFT
targets, exact-match scoring, and what a text run logs."""

import json
import random
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from scripts.generate import main as generate_main
from scripts.make_sft_data import main as make_sft_data_main
from src.checkpoints.restore import restore
from src.data.corpus.tokenizers import ByteTokenizer, build_tokenizer, load_pretrained
from src.data.text.packed_text import PackedTextDataModule
from src.data.text.pretraining import TextDataModule
from src.data.text.sft import SFTDataModule
from src.data.text.synthetic_sft import TASKS, make_examples
from src.models.language.exact_match import count_exact_matches
from src.models.language.qwen import QwenConfig
from src.utils.errors import ConfigError
from tests.helpers import FAST, TINY_LM, compose_config, text_lm_overrides
from train import train

PARAGRAPHS = [
    f"Paragraph {i}: " + " ".join(["word"] * (1 + (i * 7) % 40)) for i in range(60)
]  # lengths from a few bytes to ~230


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(PARAGRAPHS) + "\n")
    return path


def text_module(corpus, tmp_path, **options) -> TextDataModule:
    options = {"max_seq_len": 256, "batch_size": 4, "cache_dir": str(tmp_path / "cache")} | options
    module = TextDataModule(paths=[str(corpus)], **options)
    module.setup()
    return module


def all_samples(module: PackedTextDataModule, split: str) -> list[tuple[int, ...]]:
    return sorted(tuple(s.tokens.tolist()) for s in module.datasets[split].samples)


def test_documents_are_split_by_document_and_the_split_follows_split_seed(corpus, tmp_path):
    module = text_module(corpus, tmp_path)
    splits = {split: set(all_samples(module, split)) for split in ("train", "val", "test")}
    assert sum(map(len, splits.values())) == len(PARAGRAPHS)
    assert not (splits["train"] & splits["val"])
    assert not (splits["train"] & splits["test"])
    assert all_samples(text_module(corpus, tmp_path, shuffle_seed=7), "val") == sorted(
        splits["val"]
    )
    assert all_samples(text_module(corpus, tmp_path, split_seed=5), "val") != sorted(splits["val"])


def test_packed_and_padded_runs_see_the_same_samples(corpus, tmp_path):
    packed = text_module(corpus, tmp_path, packing=True)
    padded = text_module(corpus, tmp_path, packing=False)
    assert all_samples(packed, "train") == all_samples(padded, "train")
    assert len(packed.datasets["train"]) < len(padded.datasets["train"])
    loader = packed.train_dataloader()
    first_rows = list(loader.sampler)[:4]
    batch = next(iter(loader))
    assert batch["input_ids"].shape == (4, 256)
    documents = [len(packed.datasets["train"].rows[i]) for i in first_rows]
    assert (batch["document_lengths"] > 0).sum(dim=1).tolist() == documents
    assert sum(documents) > 4, "rows of 256 tokens hold several paragraphs"


def test_bucketing_by_length_pads_less_and_still_serves_every_sample(tmp_path):
    def padding_and_samples(**options):
        module = SFTDataModule(cache_dir=str(tmp_path), packing=False, batch_size=16, **options)
        module.setup()
        batches = list(module.train_dataloader())
        real = sum(int(b["document_lengths"].sum()) for b in batches)
        slots = sum(b["input_ids"].numel() for b in batches)
        return 1 - real / slots, sum(len(b["input_ids"]) for b in batches)

    plain, plain_count = padding_and_samples()
    bucketed, bucketed_count = padding_and_samples(bucket_by_length=True)
    assert bucketed < plain / 2
    assert bucketed_count == plain_count  # full batches of the same samples, other groupings
    with pytest.raises(ConfigError, match=r"data\.packing=false"):
        SFTDataModule(packing=True, bucket_by_length=True)


def test_every_document_ends_with_the_end_of_text_token(corpus, tmp_path):
    module = text_module(corpus, tmp_path)
    sample = module.datasets["train"].samples[0]
    assert sample.tokens[-1] == ByteTokenizer.eos_token_id
    assert module.tokenizer.decode(sample.tokens.tolist()).startswith("Paragraph")


def test_every_rank_gets_the_same_number_of_batches(corpus, tmp_path):
    module = text_module(corpus, tmp_path, batch_size=2)
    counts = set()
    for rank in (0, 1):
        module.trainer = SimpleNamespace(world_size=2, global_rank=rank)
        counts.add(len(list(module.train_dataloader())))
    assert len(counts) == 1


def counting_reads(module: PackedTextDataModule) -> list[int]:
    """Record every read of the corpus (which happens only to tokenise it or train a BPE)."""
    reads = []
    original = module.read_corpus
    module.read_corpus = lambda *args: reads.append(1) or original(*args)
    return reads


def test_a_second_run_reads_the_token_store_and_a_changed_file_misses_it(corpus, tmp_path):
    text_module(corpus, tmp_path)
    cached = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    reads = counting_reads(cached)
    cached.setup()
    assert reads == [], "tokenised again despite the store"
    corpus.write_text(corpus.read_text() + "\n\nOne more paragraph.\n")
    changed = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    reads = counting_reads(changed)
    changed.setup()
    assert reads == [1]
    assert changed.token_store.num_documents == len(PARAGRAPHS) + 1


def test_the_process_that_fills_the_store_reads_the_files_once(corpus, tmp_path):
    module = TextDataModule(paths=[str(corpus)], cache_dir=str(tmp_path / "cache"))
    reads = counting_reads(module)
    module.prepare_data()
    module.setup()
    assert len(reads) == 1
    assert (tmp_path / "cache").is_dir()
    samples = sum(len(module.datasets[split].samples) for split in ("train", "val", "test"))
    assert samples == len(PARAGRAPHS), "every paragraph is a sample of exactly one split"


def test_a_bpe_tokenizer_is_trained_on_the_training_text_and_reused(corpus, tmp_path):
    options = {"kind": "bpe", "vocab_size": 300}
    module = text_module(corpus, tmp_path, tokenizer=options)
    assert module.vocab_size == 300
    text = "Paragraph 3: word word"
    assert module.tokenizer.decode(module.tokenizer.encode(text)) == text
    assert len(module.tokenizer.encode(text)) < len(text.encode())  # merges learned
    again = text_module(corpus, tmp_path, tokenizer=options)
    assert again.tokenizer.fingerprint == module.tokenizer.fingerprint


def test_a_hugging_face_tokenizer_folder_gives_the_same_ids_as_transformers(corpus, tmp_path):
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    trained = build_tokenizer("bpe", vocab_size=300, training_texts=lambda: iter(PARAGRAPHS))
    folder = tmp_path / "hf_tokenizer"
    PreTrainedTokenizerFast(
        tokenizer_object=trained.tokenizer, eos_token="<|endoftext|>"
    ).save_pretrained(folder)
    module = text_module(corpus, tmp_path, tokenizer={"path": str(folder)})
    reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    text = "Paragraph 12: word word word"
    assert module.tokenizer.encode(text) == reference.encode(text, add_special_tokens=False)
    assert module.tokenizer.eos_token_id == reference.eos_token_id


def test_a_folder_without_tokenizer_json_is_refused(tmp_path):
    with pytest.raises(Exception, match=r"has no tokenizer\.json"):
        load_pretrained(tmp_path)


@pytest.fixture
def chats(tmp_path):
    path = tmp_path / "chats.jsonl"
    records = [
        {"prompt": "2+2=", "response": "4"},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another?"},
                {"role": "assistant", "content": "Red."},
            ]
        },
    ] * 20
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def sft_module(path, tmp_path, **options) -> SFTDataModule:
    options = {"max_seq_len": 128, "cache_dir": str(tmp_path / "cache")} | options
    module = SFTDataModule(path=str(path), **options)
    module.setup()
    return module


@pytest.mark.parametrize("tokenizer", [{"kind": "byte"}, {"kind": "bpe", "vocab_size": 300}])
def test_sft_targets_are_the_answers_and_their_stop_tokens_only(chats, tmp_path, tokenizer):
    module = sft_module(chats, tmp_path, tokenizer=tokenizer)
    chat = max(module.datasets["train"].samples, key=len)
    tokens, targets = chat.tokens.tolist(), chat.targets.tolist()
    assert module.tokenizer.decode(tokens).startswith("Be brief.\nUser: Name a colour.\nBot: ")
    trained = [t for t, is_target in zip(tokens, targets, strict=True) if is_target]
    eos = module.tokenizer.eos_token_id
    assert trained.count(eos) == 2  # each answer's stop token
    assert module.tokenizer.decode(trained) == "Blue.Red."
    # In a batch, the labels are exactly those targets, shifted onto the token before each.
    batch = module._loader("train", 64, shuffle=False).collate_fn([[chat]])
    assert batch["labels"][batch["labels"] != -100].tolist() == trained


def test_sft_refuses_to_split_conversations_unless_asked(chats, tmp_path):
    with pytest.raises(ConfigError, match="allow_split=true"):
        SFTDataModule(path=str(chats), overlong="split")
    SFTDataModule(path=str(chats), overlong="split", allow_split=True)


def test_exact_match_prompts_end_where_the_answer_begins(chats, tmp_path):
    module = sft_module(chats, tmp_path)
    for prompt, answer in module.exact_match_examples("val"):
        assert module.tokenizer.decode(prompt).endswith("Bot: ")
        assert answer in ("4", "Red.")


class ScriptedModel(nn.Module):
    """Answers every prompt with `answer` and a stop token, as a perfect model would."""

    def __init__(self, answer_ids: list[int], eos: int, vocab: int = 257):
        super().__init__()
        self.config = QwenConfig(model_type="qwen3", vocab_size=vocab, num_hidden_layers=1)
        self.script = [*answer_ids, eos]
        self.weight = nn.Parameter(torch.zeros(1))
        self.step = 0

    def forward(self, input_ids, cache=None):
        logits = torch.zeros(*input_ids.shape, self.config.vocab_size)
        logits[:, -1, self.script[min(self.step, len(self.script) - 1)]] = 1.0
        self.step += 1
        return logits


def test_exact_match_counts_only_answers_that_match_and_stop():
    tokenizer = ByteTokenizer()
    model = ScriptedModel(tokenizer.encode("42"), tokenizer.eos_token_id)
    examples = [(tokenizer.encode("6*7="), "42"), (tokenizer.encode("5*8="), "40")]
    assert count_exact_matches(model, tokenizer, examples) == 1  # one batch: same prompt length


def test_the_synthetic_answers_are_right_and_reproducible():
    generator = random.Random(0)
    for _ in range(20):
        prompt, answer = TASKS["add"](generator)
        a, b = prompt.removesuffix("=").split("+")
        assert int(a) + int(b) == int(answer)
        prompt, answer = TASKS["reverse_words"](generator)
        assert answer.split() == prompt.split()[1:][::-1]
        prompt, answer = TASKS["sort_letters"](generator)
        assert answer == "".join(sorted(prompt.split()[1]))
    examples = make_examples(200, seed=3)
    assert examples == make_examples(200, seed=3) != make_examples(200, seed=4)
    forms = {frozenset(example) for example in examples}
    assert forms == {frozenset({"messages"}), frozenset({"prompt", "response"})}


def test_a_text_run_logs_its_packing_and_draws_its_sample_lengths(corpus, tmp_path):
    overrides = [
        *FAST,
        *TINY_LM,
        *text_lm_overrides(corpus),
        "data.max_seq_len=128",
        "data.batch_size=4",
        "data.tokenizer.kind=bpe",
        "data.tokenizer.vocab_size=300",
        "model.config.vocab_size=320",
        "trainer.log_every_n_steps=1",
        "callbacks.throughput.warmup_steps=1",
        "test=false",
    ]
    record = train(compose_config(tmp_path / "run", overrides))
    png = (tmp_path / "run" / "plots" / "sample_lengths.png").read_bytes()
    assert png.startswith(b"\x89PNG"), "not a drawn PNG"
    assert len(png) > 5_000, "not a drawn PNG"
    assert load_pretrained(tmp_path / "run" / "tokenizer").vocab_size == 300
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    restored = restore(last)
    assert restored.tokenizer.vocab_size == 300  # the checkpoint carries it
    (text,) = generate_main(["--ckpt", str(last), "--prompt", "Paragraph", "--max-new-tokens", "3"])
    assert text.startswith("Paragraph")
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    restored.datamodule.setup()
    train_tokens = sum(len(s) for s in restored.datamodule.datasets["train"].samples)
    assert report["data/tokens_input"] == report["data/tokens_kept"] == train_tokens
    assert report["data/documents_per_row"] > 1
    metrics = record["metrics"]
    assert metrics["perf/padding_fraction"] < 0.2
    assert metrics["perf/documents_per_row"] > 1
    assert metrics["perf/real_tokens_per_s"] > 0
    assert metrics["perf/supervised_tokens_per_s"] > 0


def test_make_sft_data_writes_a_file_that_trains(tmp_path):
    path = make_sft_data_main(["--out", str(tmp_path / "sft.jsonl"), "--count", "300"])
    module = sft_module(path, tmp_path)
    assert sum(len(module.datasets[s].samples) for s in ("train", "val", "test")) == 300 - sum(
        module.accounting[s].samples_dropped for s in ("train", "val", "test")
    )
