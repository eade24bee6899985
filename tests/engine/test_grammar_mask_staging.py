"""The grammar mask buffers' one copy a step: skipped where the device already masks no row."""

from __future__ import annotations

import torch
from loraplex.engine.cuda.staging import GrammarMaskBuffers


def test_a_step_without_grammar_rows_after_another_sends_no_mask_upload() -> None:
    """The grammar mask buffer's upload is skipped where the device already masks no row; any grammar row, and
    the first step after one (which clears the device's indices), still sends."""

    masks = GrammarMaskBuffers(4, 64, 64, torch.device("cpu"))
    masks.upload(masks.max_rows)  # no grammar rows: the device's indices are -1
    assert masks.indices.tolist() == [-1] * 4
    masks.host_indices[:] = 7  # were the host's words sent, the device would read 7s
    masks.upload(masks.max_rows)
    assert masks.indices.tolist() == [-1] * 4  # skipped
    masks.host_indices[:] = [0, -1, -1, -1]
    masks.upload(masks.max_rows + masks.words)  # a grammar row in row 0
    assert masks.indices.tolist() == [0, -1, -1, -1]
    masks.host_indices[:] = -1
    masks.upload(masks.max_rows)  # the step after: its clear is sent
    assert masks.indices.tolist() == [-1] * 4
