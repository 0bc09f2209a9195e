"""Packing metadata, exactly: rows, positions, boundaries, labels, SFT masks, over-long policies."""

import itertools
import random

import numpy as np
import pytest
import torch

from src.data.corpus.rows import PackedRows
from src.data.corpus.token_store import StoreWriter, TokenStore
from src.data.packing.collate import IGNORE_INDEX, collate_rows
from src.data.packing.packing import Sample, fit_to_length, pack
from src.utils.errors import DataError

X = IGNORE_INDEX


def sample(tokens, targets=None) -> Sample:
    targets = [True] * len(tokens) if targets is None else targets
    return Sample(torch.tensor(tokens), torch.tensor(targets, dtype=torch.bool))


def test_a_packed_batch_derives_every_field_from_the_document_lengths():
    rows = [
        [sample([11, 12, 13]), sample([21]), sample([31, 32])],  # a one-token document
        [sample([41, 42, 43, 44])],
    ]
    batch = collate_rows(rows, pad_id=0, row_length=8)
    assert batch["input_ids"].tolist() == [
        [11, 12, 13, 21, 31, 32, 0, 0],
        [41, 42, 43, 44, 0, 0, 0, 0],
    ]
    assert batch["document_lengths"].tolist() == [[3, 1, 2], [4, 0, 0]]
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 0, 0, 1, 2, 3],  # padding continues the last document
        [0, 1, 2, 3, 4, 5, 6, 7],
    ]
    # Row starts (0, 8) included; the padding is the tail of its row's last document.
    assert batch["cu_seqlens"].tolist() == [0, 3, 4, 8, 16]
    assert batch["cu_seqlens"].dtype == torch.int32
    assert batch["document_index"].tolist() == [
        [0, 0, 0, 1, 2, 2, -1, -1],
        [3, 3, 3, 3, -1, -1, -1, -1],
    ]
    # Shifted within each document: never a target across a boundary, nothing on padding.
    assert batch["labels"].tolist() == [
        [12, 13, X, X, 32, X, X, X],
        [42, 43, 44, X, X, X, X, X],
    ]


def as_lists(rows) -> list[list[int]]:
    return [row.tolist() for row in rows]


def store_of(tmp_path, documents: list[list[int]], targets: list[list[bool]] | None = None):
    """A token store holding `documents` (and their target masks)."""
    writer = StoreWriter(tmp_path / "store", "test", 1000, has_targets=targets is not None)
    flat = np.array([t for d in documents for t in d], dtype=np.int64)
    mask = None if targets is None else np.array([t for m in targets for t in m])
    writer.add(flat, np.array([len(d) for d in documents]), mask)
    writer.finish()
    return TokenStore.open(tmp_path / "store", "test")


def test_cu_seqlens_invariants_hold_on_random_packings():
    generator = random.Random(0)
    for _ in range(50):
        lengths = [generator.randint(1, 16) for _ in range(generator.randint(1, 30))]
        rows = pack(lengths, 16, generator.choice(["best_fit", "greedy"]))
        samples = [sample(list(range(1, n + 1))) for n in lengths]
        batch = collate_rows([[samples[i] for i in row] for row in rows], pad_id=0, row_length=16)
        cu = batch["cu_seqlens"].tolist()
        assert cu[0] == 0
        assert cu[-1] == batch["input_ids"].numel()
        assert all(b > a for a, b in itertools.pairwise(cu))
        assert set(range(0, len(rows) * 16, 16)) <= set(cu)  # every row start
        assert len(cu) - 1 == len(lengths)  # one segment per document, none for padding
        assert batch["document_lengths"].sum() == sum(lengths)
        assert (batch["document_index"] >= 0).sum() == sum(lengths)
        assert (batch["position_ids"].flatten()[cu[:-1]] == 0).all()


def test_padded_batches_have_one_document_per_row_and_round_up_their_length():
    batch = collate_rows(
        [[sample([1, 2, 3])], [sample([4, 5, 6, 7, 8])]], pad_id=9, pad_to_multiple_of=4
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3, 9, 9, 9, 9, 9], [4, 5, 6, 7, 8, 9, 9, 9]]
    assert batch["cu_seqlens"].tolist() == [0, 8, 16]  # only row starts: plain causal rows
    assert batch["labels"].tolist() == [[2, 3, X, X, X, X, X, X], [5, 6, 7, 8, X, X, X, X]]


def test_only_response_tokens_and_the_stop_token_are_targets():
    # prompt 1 2 3 | response 4 5 | stop 6
    conversation = sample([1, 2, 3, 4, 5, 6], [False, False, False, True, True, True])
    batch = collate_rows([[conversation]], pad_id=0)
    assert batch["labels"].tolist() == [[X, X, 4, 5, 6, X]]


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_no_documents_pack_into_no_rows(strategy):
    rows = pack(np.zeros(0, np.int64), 64, strategy)
    assert len(rows) == 0
    assert list(rows) == []


def test_best_fit_decreasing_fills_the_tightest_row():
    assert as_lists(pack([5, 3, 4, 2, 6, 1], 8)) == [[4, 3], [0, 1], [2, 5]]


def test_greedy_packing_keeps_the_order():
    assert as_lists(pack([5, 3, 4, 2, 6, 1], 8, "greedy")) == [[0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("strategy", ["best_fit", "greedy"])
def test_packing_is_deterministic_and_never_overfills_a_row(strategy):
    lengths = [random.Random(1).randint(1, 64) for _ in range(500)]
    rows = as_lists(pack(lengths, 64, strategy))
    assert rows == as_lists(pack(lengths, 64, strategy))
    assert sorted(i for row in rows for i in row) == list(range(500))
    assert all(sum(lengths[i] for i in row) <= 64 for row in rows)


def test_best_fit_wastes_less_than_greedy_on_long_tailed_lengths():
    generator = random.Random(2)
    lengths = [min(256, int(generator.paretovariate(1.2) * 20)) for _ in range(2000)]
    best_fit, greedy = len(pack(lengths, 256)), len(pack(lengths, 256, "greedy"))
    assert best_fit < greedy
    assert sum(lengths) / (best_fit * 256) > 0.97


@pytest.mark.parametrize(
    ("policy", "kept", "truncated", "dropped"),
    [("truncate", [4, 2], 6, 0), ("drop", [2], 0, 10), ("split", [4, 4, 2, 2], 0, 0)],
)
def test_overlong_policies_account_for_every_token(policy, kept, truncated, dropped):
    pieces, accounting = fit_to_length([10, 2, 0], 4, policy)
    assert pieces.length.tolist() == kept
    assert (accounting.truncated, accounting.dropped) == (truncated, dropped)
    assert accounting.input == accounting.kept + accounting.truncated + accounting.dropped == 12
    assert list(accounting.lengths_before) == [10, 2, 0]
    assert list(accounting.lengths_after) == kept


def test_a_split_continuation_keeps_its_positions_and_the_target_at_the_cut(tmp_path):
    store = store_of(tmp_path, [list(range(10, 20))])
    pieces, _ = fit_to_length(store.lengths(), 4, "split")
    assert pieces.start.tolist() == [0, 4, 8]
    dataset = PackedRows(store, pieces, pack(pieces.length, 8, "greedy"))
    batch = collate_rows([dataset[0], dataset[1]], pad_id=0, row_length=8)
    assert batch["position_ids"].tolist() == [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [8, 9, 10, 11, 12, 13, 14, 15],
    ]
    # The token after each cut is still the target of the token before it.
    assert batch["labels"].tolist() == [[11, 12, 13, 14, 15, 16, 17, 18], [19, X, X, X, X, X, X, X]]
    assert batch["cu_seqlens"].tolist() == [0, 4, 8, 16]


def test_a_split_sft_continuation_has_no_target_at_the_cut_when_the_next_token_is_a_prompt(
    tmp_path,
):
    store = store_of(tmp_path, [[1, 2, 3, 4, 5, 6]], [[True, True, False, False, True, True]])
    pieces, _ = fit_to_length(store.lengths(), 2, "split")
    dataset = PackedRows(store, pieces, pack(pieces.length, 2, "greedy"))
    next_tokens = [dataset[i][0].next_token for i in range(3)]
    assert next_tokens == [X, 5, X], "a cut before a prompt token trains on nothing"


def test_truncated_samples_are_not_continued(tmp_path):
    store = store_of(tmp_path, [list(range(10, 20))])
    pieces, _ = fit_to_length(store.lengths(), 4, "truncate")
    (piece,) = PackedRows(store, pieces, pack(pieces.length, 4))[0]
    assert piece.tokens.tolist() == [10, 11, 12, 13]
    assert piece.next_token == X


def test_raise_names_the_sample_that_does_not_fit():
    with pytest.raises(DataError, match=r"^sample 1 has 5 tokens, more than max_seq_len=4"):
        fit_to_length([1, 5], 4, "raise")
