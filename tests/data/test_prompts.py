"""Prompt data for GRPO (`data=prompts`): TRL's prompt formats rendered as SFT renders a
conversation up to its answer, extra columns handed on by name, over-long prompts cut from the
left, dropped or refused, deterministic splits, and one line naming the row for a bad one."""

import json

import pytest

from src.data.text.prompts.datamodule import PromptDataModule
from src.data.text.prompts.synthetic import make_sums
from src.utils.errors import DataError


def write_rows(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def prompts(tmp_path, rows, **options) -> PromptDataModule:
    data = PromptDataModule(
        paths=[str(write_rows(tmp_path / "prompts.jsonl", rows))],
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.25,
        test_fraction=0.25,
        **options,
    )
    data.setup()
    return data


def every_row(data: PromptDataModule) -> dict:
    """Each prompt as given, with its token text and columns, over all splits."""
    found = {}
    for split in data.splits.values():
        for i, ids in enumerate(split.token_ids):
            columns = {name: values[i] for name, values in split.columns.items()}
            found[json.dumps(split.prompts[i])] = (data.tokenizer.decode(ids.tolist()), columns)
    return found


def test_text_and_conversational_prompts_are_rendered_up_to_the_answer(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2="}]
    rows = [
        {"prompt": "1+1=", "answer": "2", "level": 1},
        {"prompt": chat, "answer": "4", "level": 2},
        {"prompt": "3+3=", "answer": "6", "level": 1},
        {"prompt": "4+4=", "answer": "8", "level": 3},
    ]
    found = every_row(prompts(tmp_path, rows))
    assert found[json.dumps("1+1=")] == ("User: 1+1=\nBot: ", {"answer": "2", "level": 1})
    assert found[json.dumps(chat)] == ("Be brief.\nUser: 2+2=\nBot: ", {"answer": "4", "level": 2})


def test_a_batch_holds_right_padded_prompts_their_lengths_and_their_rows_values(tmp_path):
    rows = [{"prompt": "x" * n, "answer": str(n)} for n in range(1, 13)]
    data = prompts(tmp_path, rows, batch_size=3)
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (3, int(batch["prompt_lengths"].max()))
    for row, (length, prompt, answer) in enumerate(
        zip(batch["prompt_lengths"], batch["prompts"], batch["columns"]["answer"], strict=True)
    ):
        assert (
            data.tokenizer.decode(batch["input_ids"][row, :length].tolist())
            == f"User: {prompt}\nBot: "
        )
        assert (batch["input_ids"][row, length:] == data.tokenizer.pad_token_id).all()
        assert answer == str(len(prompt))


@pytest.mark.parametrize(
    ("overlong", "kept"), [("truncate", 8), ("drop", 4)], ids=["truncate", "drop"]
)
def test_over_long_prompts_are_cut_from_the_left_or_dropped(tmp_path, overlong, kept):
    rows = [{"prompt": f"{i}" + "y" * 40} for i in range(4)] + [
        {"prompt": f"{i}"} for i in range(4)
    ]
    data = prompts(tmp_path, rows, max_prompt_length=20, overlong=overlong)
    texts = [text for text, _ in every_row(data).values()]
    assert len(texts) == kept
    assert all(len(text) <= 20 for text in texts)
    if overlong == "truncate":
        assert all(text.endswith("\nBot: ") for text in texts), "the prompt's end is what is kept"


def test_an_over_long_prompt_is_refused_naming_its_row_when_asked(tmp_path):
    rows = [{"prompt": "short"}, {"prompt": "long " * 20}]
    with pytest.raises(
        DataError, match=r"row 2: the prompt has 112 tokens, more than data.max_prompt_length=32"
    ):
        prompts(tmp_path, rows, max_prompt_length=32, overlong="raise")


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "1+1="}, r"row 2 has no prompt: .*its columns are \['question'\]"),
        ({"prompt": "  "}, r"row 2: the prompt is empty"),
        ({"prompt": []}, r"row 2: the prompt has no messages"),
        (
            {"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}]},
            r"row 2: the prompt ends with the assistant's message",
        ),
        (
            {"prompt": [{"role": "robot", "content": "hi"}]},
            r"row 2, prompt: every message needs a role",
        ),
    ],
    ids=["no prompt", "empty", "no messages", "ends with the answer", "unknown role"],
)
def test_a_bad_row_is_one_line_naming_it(tmp_path, row, message):
    with pytest.raises(DataError, match=message) as raised:
        prompts(tmp_path, [{"prompt": "fine"}, row, {"prompt": "fine too"}])
    assert "\n" not in str(raised.value)


def test_the_synthetic_sums_are_verifiable_and_split_the_same_whatever_the_seed(tmp_path):
    rows = make_sums(500, seed=3)
    assert rows == make_sums(500, seed=3)
    assert all(int(r["answer"]) == sum(map(int, r["prompt"][:-1].split("+"))) < 10 for r in rows)
    held_out = []
    for shuffle_seed in (1, 2):
        data = PromptDataModule(
            cache_dir=str(tmp_path), synthetic_count=200, shuffle_seed=shuffle_seed
        )
        data.setup()
        assert {name: len(s) for name, s in data.splits.items()} == {
            "train": 180,
            "val": 10,
            "test": 10,
        }
        held_out.append([ids.tolist() for ids in data.splits["val"].token_ids])
    assert held_out[0] == held_out[1]
