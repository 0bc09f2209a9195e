"""Preference data (`data=preferences`, src/data/text/preference/): TRL's formats read into the
same tokens from JSONL, Parquet and folders, prompts never supervised, over-long prompts cut from
the left and counted, bad rows refused in one line naming the row, pairs kept whole through
splits and packing, and reference log-probabilities computed once and found again."""

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from src.data.text.chat_template import ChatTemplate
from src.data.text.preference.datamodule import PreferenceDataModule
from src.data.text.preference.records import PreferencePair, render_pairs
from src.data.text.preference.synthetic import make_pairs
from src.utils.contracts import IGNORE_INDEX
from src.utils.errors import ConfigError, DataError
from tests.data.support import CHATML, tokenizer_folder

PROMPTS = [f"What is {i}+{i}?" for i in range(10)]
CHOSEN = [str(2 * i) for i in range(10)]
REJECTED = [str(2 * i + 1) for i in range(10)]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


# One set of pairs in each of TRL's formats.
FORMATS = {
    "text": [
        {"prompt": p, "chosen": c, "rejected": r}
        for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)
    ],
    "conversational": [
        {"prompt": [user(p)], "chosen": [assistant(c)], "rejected": [assistant(r)]}
        for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)
    ],
    "implicit conversational": [
        {"chosen": [user(p), assistant(c)], "rejected": [user(p), assistant(r)]}
        for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)
    ],
    "implicit text": [  # 2*5 = 10 and 11 share their "1": the prompt ends at the space
        {"chosen": f"{p} {c}", "rejected": f"{p} {r}"}
        for p, c, r in zip(PROMPTS, CHOSEN, REJECTED, strict=True)
    ],
}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def preferences(tmp_path: Path, paths: list, **options) -> PreferenceDataModule:
    options = {
        "max_seq_len": 64,
        "batch_size": 2,
        "val_fraction": 0.2,
        "test_fraction": 0.1,
        "cache_dir": str(tmp_path / "cache"),
        "num_proc": 1,
    } | options
    module = PreferenceDataModule(paths=[str(p) for p in paths], **options)
    module.setup()
    return module


def documents(module: PreferenceDataModule) -> list[tuple[list[int], list[bool]]]:
    store = module.store()
    assert store.targets is not None
    return [
        (store.tokens[a:b].tolist(), (store.targets[a:b] != 0).tolist())
        for a, b in zip(store.offsets[:-1], store.offsets[1:], strict=True)
    ]


def test_every_format_and_file_kind_gives_the_same_tokens(tmp_path):
    expected = documents(
        preferences(tmp_path / "0", [write_jsonl(tmp_path / "t.jsonl", FORMATS["text"])])
    )
    for name, rows in FORMATS.items():
        path = write_jsonl(tmp_path / name / "pairs.jsonl", rows)
        assert documents(preferences(tmp_path / name, [path])) == expected, name
    pq.write_table(pa.Table.from_pylist(FORMATS["conversational"]), tmp_path / "pairs.parquet")
    parquet = preferences(tmp_path / "parquet", [tmp_path / "pairs.parquet"])
    assert documents(parquet) == expected, "parquet"
    folder = tmp_path / "folder"
    write_jsonl(folder / "a.jsonl", FORMATS["text"][:4])
    (folder / "b.json").write_text(json.dumps(FORMATS["text"][4:]))
    assert documents(preferences(tmp_path / "in_folder", [folder])) == expected, "a folder"


def test_only_the_responses_and_their_stop_tokens_are_supervised(tmp_path):
    module = preferences(tmp_path, [write_jsonl(tmp_path / "p.jsonl", FORMATS["text"])])
    docs = documents(module)
    for pair, (prompt, chosen, rejected) in enumerate(zip(PROMPTS, CHOSEN, REJECTED, strict=True)):
        for (tokens, targets), response in zip(
            docs[2 * pair : 2 * pair + 2], (chosen, rejected), strict=True
        ):
            context = f"User: {prompt}\nBot: "
            assert bytes(tokens[: len(context)]).decode() == context
            assert targets == [False] * len(context) + [True] * (len(response) + 1)
    batch = next(iter(module.val_dataloader()))
    supervised = (batch["labels"] != IGNORE_INDEX).sum()
    responses = [len(CHOSEN[p]) + len(REJECTED[p]) + 2 for p in module.datasets["val"].pairs]
    assert supervised == sum(responses[: len(batch["pair_documents"])])


def test_a_long_prompt_is_cut_from_the_left_and_counted(tmp_path):
    long = "tell me " * 12 + "what 2+2 is"
    rows = FORMATS["text"] + [{"prompt": long, "chosen": "four", "rejected": "five"}]
    module = preferences(tmp_path, [write_jsonl(tmp_path / "p.jsonl", rows)], max_seq_len=40)
    split, rows_of = next((s, d) for s, d in module.datasets.items() if 10 in d.pairs)
    pair = rows_of.pair(int(np.flatnonzero(rows_of.pairs == 10)[0]))
    for sample, response in ((pair.chosen, "four"), (pair.rejected, "five")):
        whole = f"User: {long}\nBot: {response}".encode()
        assert len(sample) == 40
        assert bytes(sample.tokens[:-1].tolist()) == whole[-39:]  # then the end-of-text token
        assert sample.targets.sum() == len(response) + 1
        assert int(sample.position_offset) == 0
    accounting = module.accounting[split]
    cut = 2 * (len(f"User: {long}\nBot: ") + 4 + 1 - 40)
    assert (accounting.truncated, accounting.samples_truncated) == (cut, 2)
    assert accounting.input == accounting.kept + accounting.truncated


ROW = {"prompt": "a", "chosen": "b", "rejected": "c"}
# Row 3 of an otherwise good file, options, and what the error says.
BAD_ROWS = {
    "a missing column": ({}, {}, "needs the columns chosen and rejected"),
    "a null response": (ROW | {"rejected": None}, {}, "row 3 has no rejected"),
    "an empty chosen": (ROW | {"chosen": " "}, {}, "row 3: the chosen response is empty"),
    "mixed formats": (
        ROW | {"chosen": [assistant("b")], "rejected": [assistant("c")]},
        {},
        "row 3: a text prompt takes text responses",
    ),
    "no shared prompt": (
        {"chosen": "x y", "rejected": "z y"},
        {},
        "row 3: chosen and rejected share no beginning",
    ),
    "a response longer than the sequence": (
        ROW | {"chosen": "b" * 80},
        {},
        "row 3: its chosen response has 81 tokens, too many for data.max_seq_len=64",
    ),
    "a prompt longer than the sequence": (
        ROW | {"prompt": "a" * 80},
        {"overlong": "raise"},
        r"row 3: its chosen sequence has 94 tokens \(a prompt of 92\), more than data.max_seq",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_is_one_line_naming_it(tmp_path, case):
    row, options, message = BAD_ROWS[case]
    rows = [*FORMATS["text"][:2], row, *FORMATS["text"][2:]]
    if case == "a missing column":  # no row has it
        rows = [{"prompt": r["prompt"], "chosen": r["chosen"]} for r in FORMATS["text"]]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    with pytest.raises(DataError, match=message) as raised:
        preferences(tmp_path, [path], **options)
    assert "\n" not in str(raised.value), str(raised.value)


def test_pairs_stay_whole_through_splits_and_packed_rows(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", make_pairs(60, seed=3))
    module = preferences(tmp_path, [path], max_seq_len=96, batch_size=3)
    splits = {split: set(rows.pairs.tolist()) for split, rows in module.datasets.items()}
    assert sorted(set.union(*splits.values())) == list(range(60))
    assert sum(map(len, splits.values())) == 60  # each pair in one split, both its documents
    rows = module.datasets["train"]
    for index in range(len(rows)):
        item = rows[index]
        assert sum(len(pair) for pair in item) <= 2 * 96
    batch = next(iter(module.train_dataloader()))
    chosen, rejected = batch["pair_documents"].unbind(1)
    assert (rejected == chosen + 1).all()  # side by side in their row
    assert batch["input_ids"].shape[1] == 2 * 96


def test_padded_batches_put_the_chosen_rows_before_the_rejected(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", FORMATS["text"])
    module = preferences(tmp_path, [path], packing=False, batch_size=3)
    batch = next(iter(module.train_dataloader()))
    assert batch["input_ids"].shape[0] == 6
    assert batch["pair_documents"].tolist() == [[0, 3], [1, 4], [2, 5]]


def fake_reference(calls: list):
    """A stand-in reference: each pair's (chosen, rejected) sequence lengths, as float32."""

    def compute(batch: dict) -> torch.Tensor:
        calls.append(len(batch["pair_documents"]))
        lengths = torch.bincount(batch["document_index"][batch["document_index"] >= 0])
        return lengths[batch["pair_documents"]].float()

    return compute


def test_reference_log_probabilities_are_computed_once_then_found_and_checked(tmp_path, caplog):
    path = write_jsonl(tmp_path / "p.jsonl", FORMATS["text"])
    calls: list = []
    module = preferences(tmp_path, [path], precompute_ref_logps=True)
    module.serve_reference_logps("weights-a", fake_reference(calls))
    assert sum(calls) == 10
    for rows in module.datasets.values():
        for number in range(len(rows.pairs)):
            pair = rows.pair(number)
            assert pair.reference == (len(pair.chosen), len(pair.rejected))
    batch = next(iter(module.train_dataloader()))
    assert batch["reference_logps"].shape == (len(batch["pair_documents"]), 2)

    again = preferences(tmp_path, [path], precompute_ref_logps=True)
    again.serve_reference_logps("weights-a", fake_reference(calls))
    assert sum(calls) == 10, "found stored, not computed again"
    stored = next(again.store().folder.glob("ref-logps-*.bin"))
    data = bytearray(stored.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern changed, the size kept
    stored.write_bytes(bytes(data))
    again = preferences(tmp_path, [path], precompute_ref_logps=True)
    again.serve_reference_logps("weights-a", fake_reference(calls))
    assert sum(calls) == 20
    assert "does not match its checksum" in caplog.text
    again.serve_reference_logps("weights-b", fake_reference(calls))
    assert sum(calls) == 30, "other reference weights, other values"


def test_values_to_evaluate_with_are_found_or_refused_never_computed(tmp_path):
    module = preferences(
        tmp_path, [write_jsonl(tmp_path / "p.jsonl", FORMATS["text"])], precompute_ref_logps=True
    )
    with pytest.raises(DataError, match=r"not in .*: evaluate with the data\.cache_dir it trained"):
        module.serve_reference_logps("weights-never-computed", compute=None)


def test_reference_log_probabilities_need_the_data_option(tmp_path):
    module = preferences(tmp_path, [write_jsonl(tmp_path / "p.jsonl", FORMATS["text"])])
    with pytest.raises(ConfigError, match=r"set data\.precompute_ref_logps=true"):
        module.serve_reference_logps("weights", fake_reference([]))


def test_a_chat_template_supervises_the_response_and_not_the_prompts_answers(tmp_path):
    template = ChatTemplate(tokenizer_folder(tmp_path / "chatml", CHATML))
    prompt = [user("Name a colour."), assistant("Blue."), user("Another?")]
    pair = PreferencePair(prompt, [assistant("Red.")], [assistant("Green.")])
    chosen, rejected = render_pairs([pair], ["row 1"], template)
    for pieces, answer in ((chosen, "Red."), (rejected, "Green.")):
        assert [text for text, target in pieces if target] == [f"{answer}<|im_end|>"]
        assert "".join(text for text, _ in pieces if text).startswith("<|im_start|>user\nName")
