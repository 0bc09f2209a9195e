"""Token columns for `Dataset.map`: flat arrays of token ids and lengths in, Arrow lists out.

Arrow list columns come out, so that a batch of documents never becomes Python lists of ints.
"""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


def append_token(values: np.ndarray, lengths: np.ndarray, token: int) -> np.ndarray:
    """`values` (sequences back to back, `lengths` long) with `token` after each sequence."""
    ends = np.cumsum(lengths + 1) - 1
    joined = np.full(len(values) + len(lengths), token, dtype=np.int64)
    is_value = np.ones(len(joined), dtype=bool)
    is_value[ends] = False
    joined[is_value] = values
    return joined


def list_column(values: np.ndarray, lengths: np.ndarray, dtype: np.dtype) -> pa.LargeListArray:
    """The sequences of `values` (back to back, `lengths` long) as one Arrow list per row."""
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values.astype(dtype)))


def flat_column(column: pa.ListArray | pa.LargeListArray) -> tuple[np.ndarray, np.ndarray]:
    """(values back to back, one length per row) of an Arrow list column."""
    return pc.list_flatten(column).to_numpy(), pc.list_value_length(column).to_numpy()
