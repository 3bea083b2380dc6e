"""ModelRunner: scheduled chunks in, logits out. The only room that builds tensors for the model:
token ids, positions, slot mapping and per-group key slots and masks (see layers/attention.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenhaul.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenhaul.kv.cache import KVCache
from tokenhaul.layers.attention import AttentionMetadata, AttnGroup
from tokenhaul.models.registry import Model


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] rows of the hidden states whose logits are sampled
    sample_chunks: list[ScheduledChunk]  # the N chunks that sample, in row order
    kv_view_slots: int = 0  # key slots per layer read in place (consecutive blocks), not gathered


class ModelRunner:
    def __init__(self, model: Model, kv: KVCache, device: str | torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = torch.device(device)
        self.block_size = kv.block_size
        self.window = model.config.sliding_window

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        """Order tokens decodes-first, then each prefill chunk; build metadata on the CPU, move once."""
        for src, dst in sched.block_copies:
            self.kv.copy_block(src, dst)
        decodes = [c for c in sched.chunks if c.num_tokens == 1]
        prefills = [c for c in sched.chunks if c.num_tokens > 1]
        ids: list[int] = []
        pos: list[int] = []
        for c in decodes + prefills:
            ids += c.request.token_slice(c.start, c.start + c.num_tokens)
            pos += range(c.start, c.start + c.num_tokens)
        positions = torch.tensor(pos, dtype=torch.long)
        groups: list[AttnGroup] = []
        slot_parts: list[torch.Tensor] = []
        row = 0
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        single = len(decodes) + len(prefills) == 1
        bs = self.block_size
        if decodes:
            kv_len = torch.tensor([c.start + 1 for c in decodes])
            table = self._block_table([c.request.block_ids for c in decodes], int(kv_len.max()))
            pos_last = kv_len - 1
            slot_parts.append(table.gather(1, (pos_last // bs)[:, None])[:, 0] * bs + pos_last % bs)
            mask, local = self._masks(pos_last[:, None], table.shape[1] * bs)
            idx = None if single or not prefills else torch.arange(len(decodes))
            start = self._consecutive(decodes[0].request.block_ids, table.shape[1]) if len(decodes) == 1 else None
            groups.append(AttnGroup(len(decodes), 1, idx, table, mask, local, start))
            for r, c in enumerate(decodes):
                if c.samples:  # a 1-token chunk mid-prompt does not sample
                    sample_rows.append(r)
                    sample_chunks.append(c)
            row = len(decodes)
        for c in prefills:
            end = c.start + c.num_tokens
            table = self._block_table([c.request.block_ids], end)
            p = torch.arange(c.start, end)
            slot_parts.append(table[0, p // bs] * bs + p % bs)
            mask, local = self._masks(p[None, :], table.shape[1] * bs)
            idx = None if single else torch.arange(row, row + c.num_tokens)
            groups.append(AttnGroup(1, c.num_tokens, idx, table, mask, local,
                                    self._consecutive(c.request.block_ids, table.shape[1])))
            row += c.num_tokens
            if c.samples:
                sample_rows.append(row - 1)
                sample_chunks.append(c)
        view_slots = sum(g.block_table.shape[1] * bs for g in groups if g.block_start is not None)
        dev = self.device
        meta = AttentionMetadata(positions.to(dev), torch.cat(slot_parts).to(dev),
                                 [self._to(g) for g in groups], len(ids))
        return ModelInput(torch.tensor(ids, dtype=torch.long, device=dev), meta,
                          torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_chunks, view_slots)

    @torch.inference_mode()
    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Run the model; return fp32 logits [N, vocab] for the sampling rows."""
        hidden = self.model.forward(inp.input_ids, inp.meta, self.kv)
        return self.model.compute_logits(hidden[inp.sample_rows])

    @staticmethod
    def _consecutive(block_ids: list[int], n: int) -> int | None:
        """First block id if the first n blocks are b, b+1, …, b+n-1 (attention can then read a view)."""
        first = block_ids[0]
        return first if block_ids[n - 1] - first == n - 1 and block_ids[:n] == list(range(first, first + n)) else None

    def _block_table(self, tables: list[list[int]], length: int) -> torch.Tensor:
        """Blocks holding positions [0, length) of each sequence → [B, num_blocks] (padding → block 0)."""
        nb = -(-length // self.block_size)
        return torch.tensor([(t + [0] * nb)[:nb] for t in tables], dtype=torch.long)

    def _masks(self, q_pos: torch.Tensor, kv_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Causal masks [B, 1, Q, kv_len] (keys past a query's position, including block padding, are
        hidden) and the same with the sliding window; None where every key is visible."""
        k = torch.arange(kv_len)
        causal = k[None, None, :] <= q_pos[:, :, None]
        mask = None if bool(causal.all()) else causal.unsqueeze(1)
        local = mask
        if self.window is not None and int(q_pos.max()) >= self.window:
            local = (causal & (k[None, None, :] > q_pos[:, :, None] - self.window)).unsqueeze(1)
        return mask, local

    def _to(self, g: AttnGroup) -> AttnGroup:
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(self.device)

        return AttnGroup(g.batch, g.q_len, mv(g.token_index), mv(g.block_table), mv(g.mask), mv(g.mask_local),
                         g.block_start)
