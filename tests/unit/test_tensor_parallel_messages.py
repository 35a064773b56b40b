"""Tensor parallelism's step messages: fixed-layout int64 arrays, checked, never unpickled.

Before, rank 0 sent each step with paddle's ``broadcast_object_list``, and every other rank
unpickled what arrived: whoever could reach the collectives could run code in every rank.
These tests send what such an attacker would (a pickle that creates a file when loaded) in
every place the layout has, and check that it is refused and that the file never appears;
and that every message the engine really sends comes back as it was sent.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from specdec.attention import AttentionMetadata
from specdec.engine.tensor_parallel_messages import (HEADER_SIZE, MAGIC, Forward, InitCache, Kind, Limits,
                                                     MessageError, Ping, Stop, decode, encode, payload_length)

LIMITS = Limits(vocab_size=49152, max_positions=1045, num_blocks=96, block_size=16)


class CreatesAFile:
    """Unpickling this creates ``path``: the code an attacker would run."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (os.mknod, (self.path,))


def _as_int64(data: bytes, length: int | None = None) -> np.ndarray:
    """``data`` as the int64 values a rank would receive, zero-padded (or cut) to ``length``."""
    padded = data + b"\0" * (-len(data) % 8)
    values = np.frombuffer(padded, dtype="<i8").astype(np.int64)
    if length is not None:
        values = np.resize(np.concatenate([values, np.zeros(max(0, length - len(values)), np.int64)]), length)
    return values


def _forward() -> tuple[Forward, AttentionMetadata]:
    """A step as the engine builds it: a prefill chunk of 5 rows and two decode rows of a
    request 40 positions in, with the logits of the last prefill row and of both decode rows."""
    tables = np.array([[3, 0, 0], [7, 8, 9]], np.int32)
    meta = AttentionMetadata.build([5, 2], [0, 40], tables, 16)
    token_ids = np.array([1, 2, 3, 4, 5, 900, 49151], np.int64)
    return Forward.of(token_ids, meta, np.array([4, 5, 6], np.int64)), meta


def test_a_pickled_payload_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "pwned"
    evil = pickle.dumps(CreatesAFile(marker))
    # What broadcast_object_list sent: the pickle's bytes, in place of a header...
    with pytest.raises(MessageError, match="wrong magic"):
        payload_length(_as_int64(evil, HEADER_SIZE), LIMITS)
    # ...or behind a valid forward header whose sizes match the pickle's length.
    values = _as_int64(evil)
    header = np.array([MAGIC, Kind.FORWARD, len(values) - 2, 1, 0, 16, 0, 0], np.int64)
    assert payload_length(header, LIMITS) == len(values)
    with pytest.raises(MessageError):
        decode(header, values, LIMITS)
    # ...or as a payload where a message has none.
    with pytest.raises(MessageError, match="carries no values"):
        decode(np.array([MAGIC, Kind.PING, *values[:6]], np.int64), None, LIMITS)
    assert not marker.exists()
    pickle.loads(evil)  # the attack is real: loading it is what the old worker did
    assert marker.exists()


def test_every_message_kind_round_trips():
    for message in (Stop(), Ping(), InitCache(96, 16)):
        header, payload = encode(message)
        assert payload is None and header.dtype == np.int64 and header.shape == (HEADER_SIZE,)
        assert payload_length(header, LIMITS) == 0
        assert decode(header, None, LIMITS) == message

    sent, meta = _forward()
    header, payload = encode(sent)
    assert payload.dtype == np.int64 and payload_length(header, LIMITS) == len(payload)
    received = decode(header, payload, LIMITS)
    np.testing.assert_array_equal(received.token_ids, sent.token_ids)
    np.testing.assert_array_equal(received.logit_rows, sent.logit_rows)
    rebuilt = received.meta()
    for field in ("query_lens", "context_lens", "block_tables", "cu_seqlens_q", "cu_seqlens_k", "positions",
                  "batch_ids", "slot_mapping"):
        np.testing.assert_array_equal(getattr(rebuilt, field), getattr(meta, field), err_msg=field)
        assert getattr(rebuilt, field).dtype == getattr(meta, field).dtype, field
    assert rebuilt.block_size == meta.block_size


def _tampered(index: int, value: int) -> tuple[np.ndarray, np.ndarray]:
    header, payload = encode(_forward()[0])
    payload = payload.copy()
    payload[index] = value
    return header, payload


@pytest.mark.parametrize("index, value, reason", [
    (0, 49152, "token id out of the vocabulary"),         # token_ids[0]
    (0, -1, "token id out of the vocabulary"),
    (7, 6, "do not sum to the rows"),                     # query_lens[0]
    (10, 2000, "out of the model's positions"),           # context_lens[1]
    (10, 100, "beyond the model's or the block table's"),   # context_lens[1]: past its 3 blocks of 16
    (14, 96, "block id out of the cache"),                # block_tables[1][0]
    (14, -5, "block id out of the cache"),
    (19, 7, "logit row out of the rows"),                 # logit_rows[2]
])
def test_a_forward_pass_out_of_bounds_is_refused(index, value, reason):
    header, payload = _tampered(index, value)
    with pytest.raises(MessageError, match=reason):
        decode(header, payload, LIMITS)


@pytest.mark.parametrize("header, reason", [
    ([MAGIC, 99, 0, 0, 0, 0, 0, 0], "unknown message kind"),
    ([MAGIC, Kind.INIT_CACHE, 0, 16, 0, 0, 0, 0], "out of bounds"),
    ([MAGIC, Kind.FORWARD, 1 << 40, 1, 1, 16, 0, 0], "out of bounds"),  # would allocate 8 TiB
    ([MAGIC, Kind.FORWARD, 4, 1 << 10, 1 << 15, 16, 0, 0], "more than"),      # within each bound, too big together
    ([MAGIC, Kind.FORWARD, 1, 1, 1, 32, 0, 0], "block size 32"),
])
def test_a_header_out_of_bounds_is_refused_before_any_payload(header, reason):
    with pytest.raises(MessageError, match=reason):
        payload_length(np.array(header, np.int64), LIMITS)


def test_lengths_whose_sum_wraps_around_are_refused():
    """Three query lengths that add up to the 1 row only modulo 2**64 (a check of the sum
    alone would pass them, and rebuilding the metadata would try to allocate 2**63 rows)."""
    header = np.array([MAGIC, Kind.FORWARD, 1, 3, 1, 16, 0, 0], np.int64)
    huge = np.iinfo(np.int64).max
    payload = np.array([1, huge, huge, 3, 0, 0, 0, 0, 0, 0], np.int64)
    assert int(payload[1:4].sum()) == 1  # numpy's int64 sum wraps
    with pytest.raises(MessageError, match="do not sum to the rows"):
        decode(header, payload, LIMITS)


def test_no_forward_pass_before_the_cache_exists():
    header, payload = encode(_forward()[0])
    with pytest.raises(MessageError, match="before init_cache"):
        decode(header, payload, Limits(vocab_size=49152, max_positions=1045))


def test_a_payload_of_the_wrong_length_is_refused():
    header, payload = encode(_forward()[0])
    with pytest.raises(MessageError, match="a payload of 20"):
        decode(header, payload[:-1], LIMITS)
