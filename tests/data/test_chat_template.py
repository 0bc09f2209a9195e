"""`data.template=tokenizer`: conversations rendered with the tokenizer folder's chat template,
supervising exactly the assistant turns and their end-of-turn token
(src/data/text/chat_template.py).

Each test builds its own tokenizer folder: a small byte-level BPE with ChatML's special tokens,
saved as transformers saves one, with a ChatML template or a Qwen3-like one that handles
`<think>` blocks as Qwen3's does."""

import json
import logging
import pickle
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from transformers import PreTrainedTokenizerFast

from src.data.corpus.tokenizers import load_pretrained
from src.data.text.chat_template import ChatTemplate
from src.data.text.sft import SFTDataModule, render_rows
from src.run.config.checks import check_config_types
from src.utils.errors import ConfigError, DataError, MissingFileError
from tests.data.support import CHATML, tokenizer_folder
from tests.helpers import compose_config

# Qwen3's rules, compactly: reasoning (in the content before </think>, or reasoning_content) is
# dropped from assistant turns before the last user message; the turns after it show a think
# block, an empty one if need be, when they are last or have reasoning.
QWEN3_LIKE = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- set reasoning = message.reasoning_content if message.reasoning_content is string "
    "else '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n'"
    " + content + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Not prefix-stable: the first line counts the messages, so no prefix renders as the whole does.
COUNTING = "{{- messages | length }}\n" + CHATML

SYSTEM = {"role": "system", "content": "Be brief."}
MULTI_TURN = [
    {"role": "user", "content": "Name a colour."},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "Another?"},
    {"role": "assistant", "content": "Red, or green."},
]


@pytest.fixture
def chatml(tmp_path) -> Path:
    return tokenizer_folder(tmp_path / "chatml", CHATML)


@pytest.fixture
def qwen3_like(tmp_path) -> Path:
    return tokenizer_folder(tmp_path / "qwen3", QWEN3_LIKE)


def supervised(folder: Path, *conversations: list[dict]) -> list[list[str]]:
    """The supervised texts of each conversation, after checking its pieces are the template's
    whole rendering (as transformers renders it) and nothing else."""
    template = ChatTemplate(folder)
    rendered = template.render(
        list(conversations), [f"row {i + 1}" for i in range(len(conversations))]
    )
    reference = PreTrainedTokenizerFast.from_pretrained(folder)
    for conversation, pieces in zip(conversations, rendered, strict=True):
        whole = reference.apply_chat_template(conversation, tokenize=False)
        assert "".join(text for text, _ in pieces) == whole
    return [[text for text, target in pieces if target] for pieces in rendered]


def test_a_multi_turn_chat_supervises_each_answer_and_its_end_of_turn_token(chatml):
    assert supervised(chatml, MULTI_TURN) == [["Blue.<|im_end|>", "Red, or green.<|im_end|>"]]


def test_a_system_prompt_is_rendered_but_not_supervised(chatml):
    (pieces,) = ChatTemplate(chatml).render([[SYSTEM, *MULTI_TURN[:2]]], ["row 1"])
    assert pieces == [
        (
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nName a colour.<|im_end|>\n"
            "<|im_start|>assistant\n",
            False,
        ),
        ("Blue.<|im_end|>", True),
        ("\n", False),  # after the end-of-turn token: the next prompt's, never generated
    ]


def test_an_empty_assistant_turn_supervises_just_its_end_of_turn_token(chatml):
    empty_first = [MULTI_TURN[0], {"role": "assistant", "content": ""}, *MULTI_TURN[2:]]
    empty_last = [*MULTI_TURN[:3], {"role": "assistant", "content": ""}]
    assert supervised(chatml, empty_first, empty_last) == [
        ["<|im_end|>", "Red, or green.<|im_end|>"],
        ["Blue.<|im_end|>", "<|im_end|>"],
    ]


def test_prompt_response_pairs_render_as_a_user_and_an_assistant_turn(chatml):
    records = [{"prompt": "2+2=", "response": "4"}, {"messages": [SYSTEM, *MULTI_TURN]}]
    first, second = render_rows(records, [0, 1], ChatTemplate(chatml), "chats.jsonl")
    assert first == [
        ("<|im_start|>user\n2+2=<|im_end|>\n<|im_start|>assistant\n", False),
        ("4<|im_end|>", True),
        ("\n", False),
    ]
    assert [text for text, target in second if target] == [
        "Blue.<|im_end|>",
        "Red, or green.<|im_end|>",
    ]


def test_think_blocks_are_supervised_as_the_qwen3_template_renders_them(qwen3_like):
    with_reasoning = [
        MULTI_TURN[0],
        {"role": "assistant", "content": "<think>\nIt asks for one.\n</think>\n\nBlue."},
        MULTI_TURN[2],
        {"role": "assistant", "content": "Red.", "reasoning_content": "Another one."},
    ]
    empty_last = [*MULTI_TURN[:3], {"role": "assistant", "content": ""}]
    pair = [MULTI_TURN[0], {"role": "assistant", "content": "Blue."}]
    assert supervised(qwen3_like, with_reasoning, empty_last, pair) == [
        # Before the last user message the template drops the reasoning: so does the target.
        ["Blue.<|im_end|>", "<think>\nAnother one.\n</think>\n\nRed.<|im_end|>"],
        # The last turn gets an empty think block from the template, supervised with it.
        ["Blue.<|im_end|>", "<think>\n\n</think>\n\n<|im_end|>"],
        ["<think>\n\n</think>\n\nBlue.<|im_end|>"],
    ]


def test_a_template_that_is_not_prefix_stable_is_refused_naming_the_row(tmp_path):
    folder = tokenizer_folder(tmp_path / "counting", COUNTING)
    with pytest.raises(DataError, match=r"chats.jsonl, row 3: .* is not prefix-stable"):
        render_rows([{"messages": MULTI_TURN}], [2], ChatTemplate(folder), "chats.jsonl")


def test_a_conversation_the_template_refuses_is_a_data_error_naming_the_row(tmp_path):
    strict = "{%- if messages[0].role != 'user' %}{{ raise_exception('Begin with a user.') }}"
    folder = tokenizer_folder(tmp_path / "strict", strict + "{%- endif %}" + CHATML)
    records = [{"messages": MULTI_TURN}, {"messages": [SYSTEM, *MULTI_TURN]}]
    with pytest.raises(DataError, match=r"chats.jsonl, row 8: .* first 5 messages: Begin with a"):
        render_rows(records, [6, 7], ChatTemplate(folder), "chats.jsonl")


def test_a_missing_chat_template_or_tokenizer_folder_is_a_clear_config_error(tmp_path):
    folder = tokenizer_folder(tmp_path / "plain", None)
    pretrained = {"kind": "pretrained", "path": str(folder)}
    with pytest.raises(ConfigError, match=r"has none \(no chat_template.jinja and no chat_tem"):
        SFTDataModule(template="tokenizer", tokenizer=pretrained).source_options()
    with pytest.raises(ConfigError, match=r"data.tokenizer.kind=pretrained data.tokenizer.path="):
        SFTDataModule(template="tokenizer", tokenizer={"kind": "byte"})
    with pytest.raises(ConfigError, match=r"data.tokenizer.kind=pretrained data.tokenizer.path="):
        SFTDataModule(template="tokenizer")
    with pytest.raises(ConfigError, match=r"data.template='chatml'"):
        SFTDataModule(template="chatml", tokenizer=pretrained)


def test_an_end_of_text_token_other_than_the_templates_end_of_turn_is_warned_about(
    tmp_path, caplog
):
    folder = tokenizer_folder(tmp_path / "base", CHATML, eos_token="<|endoftext|>")
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": MULTI_TURN}) + "\n")
    module = SFTDataModule(
        path=str(path), template="tokenizer", tokenizer={"kind": "pretrained", "path": str(folder)}
    )
    module.tokenizer = load_pretrained(folder)
    with caplog.at_level(logging.WARNING, logger="src.data.text.sft"):
        module.encoder()
    assert "set data.tokenizer.eos_token=<|im_end|>" in caplog.text
    with pytest.raises(MissingFileError, match="is not a folder"):
        ChatTemplate(tmp_path / "missing")


def test_the_store_is_keyed_by_the_chat_template_wherever_the_folder_keeps_it(tmp_path):
    def key(folder):
        options = {"kind": "pretrained", "path": str(folder)}
        return SFTDataModule(template="tokenizer", tokenizer=options).source_options()

    in_file = tokenizer_folder(tmp_path / "file", CHATML)
    in_config = tokenizer_folder(tmp_path / "config", CHATML, in_config=True)
    assert ChatTemplate(in_config).text == ChatTemplate(in_file).text == CHATML
    before = key(in_file)
    assert before == key(tokenizer_folder(tmp_path / "again", CHATML))
    (in_file / "chat_template.jinja").write_text(QWEN3_LIKE)  # a new template: a new store
    assert key(in_file) != before


def test_the_template_travels_to_map_workers_without_its_loaded_tokenizer(chatml):
    template = ChatTemplate(chatml)
    expected = template.render([MULTI_TURN], ["row 1"])
    copy = pickle.loads(pickle.dumps(template))
    assert copy._tokenizer is None
    assert template._tokenizer is not None
    assert copy.render([MULTI_TURN], ["row 1"]) == expected


def supervised_runs(module: SFTDataModule, document: int) -> list[str]:
    """The decoded runs of supervised tokens of one document of the store, special tokens kept."""
    store = module.token_store
    begin, end = store.offsets[document], store.offsets[document + 1]
    tokens, targets = store.tokens[begin:end], store.targets[begin:end].astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate(([0], targets.view(np.int8), [0]))))
    decode = module.tokenizer.tokenizer.decode
    return [
        decode(tokens[a:b].tolist(), skip_special_tokens=False)
        for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]


EXPECTED = {  # the supervised runs of RECORDS, by template
    "chatml": [["4<|im_end|>"], ["Blue.<|im_end|>", "Red, or green.<|im_end|>"], ["<|im_end|>"]],
    "qwen3": [
        ["<think>\n\n</think>\n\n4<|im_end|>"],
        ["Blue.<|im_end|>", "<think>\nThe last.\n</think>\n\nRed, or green.<|im_end|>"],
        ["<think>\n\n</think>\n\n<|im_end|>"],
    ],
}


@pytest.mark.parametrize("template", ["chatml", "qwen3"])
def test_the_sft_datamodule_trains_on_the_chat_templates_assistant_turns(template, tmp_path):
    folder = tokenizer_folder(
        tmp_path / template, {"chatml": CHATML, "qwen3": QWEN3_LIKE}[template]
    )
    last = {**MULTI_TURN[3], "reasoning_content": "The last."}  # null in the other rows
    records = [
        {"prompt": "2+2=", "response": "4"},
        {"messages": [SYSTEM, *MULTI_TURN[:3], last]},
        {"messages": [MULTI_TURN[0], {"role": "assistant", "content": ""}]},
    ]
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records * 10))
    # As on the command line: experiment=lm_sft data.template=tokenizer data.tokenizer.path=...
    config = compose_config(
        tmp_path / "run",
        [
            "experiment=lm_sft",
            "data.template=tokenizer",
            f"data.tokenizer.path={folder}",
            f"data.path={path}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "data.max_seq_len=96",
            "data.num_proc=1",
        ],
    )
    check_config_types(config)  # what train.py checks first: a string template is allowed
    module = instantiate(config.data)
    module.setup()
    store = module.token_store
    assert store.num_documents == len(records) * 10
    for document in range(store.num_documents):
        assert supervised_runs(module, document) == EXPECTED[template][document % 3]
    reference = PreTrainedTokenizerFast.from_pretrained(folder)
    begin, end = store.offsets[1], store.offsets[2]
    document = module.tokenizer.tokenizer.decode(
        store.tokens[begin:end].tolist(), skip_special_tokens=False
    )
    assert document == reference.apply_chat_template(records[1]["messages"], tokenize=False)
    # Batches' labels are those targets; exact-match prompts end with the generation prompt.
    chat = max(module.datasets["train"].samples, key=len)
    batch = module._loader("train", 64, shuffle=False).collate_fn([[chat]])
    labels = batch["labels"][batch["labels"] != -100].tolist()
    assert labels == chat.tokens[chat.targets.bool()].tolist()
    im_end = module.tokenizer.tokenizer.token_to_id("<|im_end|>")
    assert labels.count(im_end) == 2
    answers = {runs[-1].removesuffix("<|im_end|>") for runs in EXPECTED[template]}
    for prompt, answer in module.exact_match_examples("val"):
        assert module.tokenizer.tokenizer.decode(prompt, skip_special_tokens=False).endswith(
            "<|im_start|>assistant\n"
        )
        assert answer in answers


def test_null_fields_of_a_datasets_shared_schema_do_not_reach_the_template(tmp_path):
    marks_reasoning = CHATML.replace(
        " + message.content + '<|im_end|>\\n' }}",
        " + message.content }}{%- if message.reasoning_content is defined %}R{%- endif %}"
        "{{- '<|im_end|>\\n' }}",
    )
    assert marks_reasoning != CHATML
    folder = tokenizer_folder(tmp_path / "defined", marks_reasoning)
    turns = [{**turn, "reasoning_content": None} for turn in MULTI_TURN[:2]]
    assert supervised(folder, turns) == [["Blue.<|im_end|>"]]
    turns[1]["reasoning_content"] = "why"
    assert supervised(folder, turns) == [["Blue.R<|im_end|>"]]
