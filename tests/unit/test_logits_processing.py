"""``apply_row_processors``: each request's processors see its real rows (not the padding), a
processor that raises leaves its request's rows as they were and is reported, and device logits
(a paddle tensor, as the Triton path leaves them) come back with only the processed rows changed."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specdec.engine.logits_processing import RowProcessor, apply_row_processors


class AddRow(RowProcessor):
    """Adds ``j + 1`` to row j, and records what it was shown."""

    def __init__(self):
        self.seen = []

    def process(self, logits, tokens, drafts):
        self.seen.append((logits.shape, tokens.tolist(), drafts.tolist()))
        logits += np.arange(1, logits.shape[0] + 1, dtype=np.float32)[:, None]


class Broken(RowProcessor):
    def process(self, logits, tokens, drafts):
        logits[:] = 99.0  # on its copy: must not reach the step's logits
        raise ValueError("broken")


def request(*processors, tokens=(1, 2)):
    return SimpleNamespace(row_processors=list(processors), token_ids=np.array(tokens, dtype=np.int64))


@pytest.mark.parametrize("device", [False, True], ids=["numpy", "paddle"])
def test_only_the_real_rows_of_requests_with_processors_change(device):
    logits = np.zeros((3, 3, 4), dtype=np.float32)
    drafts = np.array([[7, 8], [5, -1], [6, 6]], dtype=np.int64)
    lengths = np.array([2, 1, 2])
    adder = AddRow()
    requests = [request(adder), request(Broken()), request()]
    given = logits
    if device:
        import paddle

        given = paddle.to_tensor(logits)
    out, failures = apply_row_processors(requests, given, drafts, lengths)
    out = out if isinstance(out, np.ndarray) else out.numpy()
    assert adder.seen == [((3, 4), [1, 2], [7, 8])]
    np.testing.assert_array_equal(out[0, :, 0], [1, 2, 3])
    assert not out[1:].any()  # the broken request's rows and the request without processors
    assert [(b, str(exc)) for b, exc in failures] == [(1, "broken")]
