"""Host-to-device transfer of a step's inputs: pinned staging buffers, one copy per step.

The runner packs every integer array of a step (token ids, positions, slots, sequence lengths,
query offsets, block tables, sampled rows) back to back into one pinned int32 buffer and sends
them in one asynchronous copy; the device views are slices of the target. The grammar
bitmask has its own pinned buffer because it is filled later, while the forward runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class PinnedStaging:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.device = device
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        self.host = torch.empty(capacity, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        self.array = self.host.numpy()
        self.device_buffer = torch.empty(capacity, dtype=torch.int32, device=self.device)

    def upload(self, parts: Sequence[np.ndarray], target: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Pack `parts` and copy them in one transfer into `target` (default: the staging's own
        device buffer); returns one device view per part.

        Safe to refill on the next step: every step ends by reading its sampled tokens back,
        which waits for this copy.
        """
        sizes = [int(part.size) for part in parts]
        total = sum(sizes)
        if total > self.array.size:
            self._allocate(max(total, 2 * self.array.size))
        offset = 0
        for part, size in zip(parts, sizes, strict=True):
            self.array[offset : offset + size] = part.reshape(-1)
            offset += size
        target = self.device_buffer if target is None else target
        target[:total].copy_(self.host[:total], non_blocking=True)
        return list(torch.split(target[:total], sizes))


class GrammarMaskBuffers:
    """Bitmask rows for the sampled rows of a step, filled on the host, read by the mask kernel.

    Layout of both the pinned host buffer and its device twin: `indices [max_rows]` (row to mask,
    -1 = none), then `bitmask [max_rows, words]`. A CUDA graph reads fixed slices of the device
    buffer, so one copy of the used prefix is all a step needs.
    """

    def __init__(self, max_rows: int, vocab_size: int, tokenizer_vocab_size: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.words = (vocab_size + 31) // 32
        size = max_rows * (1 + self.words)
        self.host = torch.full((size,), -1, dtype=torch.int32, pin_memory=device.type == "cuda")
        self.host_indices = self.host[:max_rows].numpy()
        self.host_bitmask = self.host[max_rows:].view(max_rows, self.words)
        self.device_buffer = torch.full((size,), -1, dtype=torch.int32, device=device)
        self.indices = self.device_buffer[:max_rows]
        self.bitmask = self.device_buffer[max_rows:].view(max_rows, self.words)
        # Ids past the tokenizer's vocabulary are embedding padding: a grammar row never gets them.
        allowed = np.zeros(self.words * 32, dtype=np.uint8)
        allowed[:tokenizer_vocab_size] = 1
        self.vocab_words = np.packbits(allowed.reshape(-1, 32)[:, ::-1], axis=1).view(">u4").astype(np.uint32)
        self.vocab_words = self.vocab_words.reshape(-1).view(np.int32)
        self._device_clear = False  # the device's indices are all -1 (its last upload held no grammar row)

    def fill(self, seqs: Sequence, errors: dict[int, Exception], skip: frozenset[int] = frozenset()) -> int:
        """Host work, run while the GPU computes the forward: fill the grammar rows of `seqs`
        (row i = seqs[i]) but rows `skip` (sampled on the host, with their own masks); returns how many int32
        words of the buffer the upload must send."""
        self.host_indices[:] = -1
        last_row = -1
        bitmask = self.host_bitmask.numpy()
        for i, seq in enumerate(seqs):
            if seq.matcher is None or seq.forced_token_ids or i in skip:
                continue
            bitmask[i] = -1
            try:
                seq.matcher.fill_bitmask(self.host_bitmask, i)
            except Exception as exc:  # one request's grammar failing must not stop the batch
                errors[seq.seq_id] = exc
                continue
            bitmask[i] &= self.vocab_words
            self.host_indices[i] = i
            last_row = i
        return self.max_rows + (last_row + 1) * self.words

    def upload(self, count: int) -> None:
        """Send the first `count` words `fill` returned. A step without grammar rows after another one sends
        nothing: the device's indices already mask no row (most steps of most batches)."""
        no_rows = count <= self.max_rows
        if no_rows and self._device_clear:
            return
        self.device_buffer[:count].copy_(self.host[:count], non_blocking=True)
        self._device_clear = no_rows


class DrawBuffers:
    """A random draw's values for the sampled rows of a step, read by the decode graphs' draw graph.

    Rows of a pinned float32 buffer and its device twin: `uniforms [max_rows]` (the row's uniform for this
    position), `temperatures [max_rows]`, `draws [max_rows]` (1: the row draws; 0: it takes the argmax). A
    graph reads fixed slices, so one copy a step is all it needs: a draw used to make four small copies and a
    dozen launches a step, ~0.4 ms of host work at 64 rows. Two host buffers take turns: a step launched
    ahead (engine/step_overlap.py) fills one while the copy from the other may still wait on the stream.
    """

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        pin = device.type == "cuda"
        self._hosts = [torch.zeros((3, max_rows), dtype=torch.float32, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        self.device_buffer = torch.zeros((3, max_rows), dtype=torch.float32, device=device)
        self.uniforms, self.temperatures, self.draws = self.device_buffer.unbind(0)

    def upload(self, uniforms: Sequence[float], temperatures: Sequence[float], rows: Sequence[int]) -> None:
        """Row `rows[i]` draws with `uniforms[i]` at `temperatures[i]`; every other row takes the argmax.
        The buffer filled is refilled two uploads later: by then the step that read it has been read back."""
        self._turn ^= 1
        host = self._hosts[self._turn]
        array = host.numpy()
        array[0].fill(0.0)
        array[1].fill(1.0)  # never 0: a greedy row's (unused) draw must not divide by it
        array[2].fill(0.0)
        array[0, rows] = uniforms
        array[1, rows] = temperatures
        array[2, rows] = 1.0
        self.device_buffer.copy_(host, non_blocking=True)
