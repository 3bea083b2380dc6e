"""ModelRunner: scheduled chunks in, logits out. The only room that builds tensors for the model:
token ids, positions, slot mapping and per-group key slots and masks (see layers/attention.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tokenhaul.engine.attention_calls import attention_calls
from tokenhaul.engine.compiled_decode import CompiledDecode
from tokenhaul.engine.scheduler import ScheduledChunk, SchedulerOutput
from tokenhaul.kv.cache import KVCache
from tokenhaul.layers.attention import AttentionMetadata, AttnGroup, decodes_in_place
from tokenhaul.models.registry import Model


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [T]
    meta: AttentionMetadata | None  # None on a compiled decode step (the graph builds its own from `decode`)
    sample_rows: torch.Tensor  # [N] rows of the hidden states whose logits are sampled
    sample_chunks: list[ScheduledChunk]  # the chunks that sample, in row order (chunk.num_sampled rows each)
    kv_view_slots: int = 0  # key slots per layer read in place (consecutive blocks), not gathered
    attn_groups: list[tuple[int, list[int]]] = field(default_factory=list)  # (query length, KV length per sequence)
    decode: tuple[torch.Tensor, ...] | None = None  # a pure-decode step for the compiled graph: ids, positions,
    # slots, block table (engine/compiled_decode.py)
    prompt_rows: torch.Tensor | None = None  # [M] rows whose hidden states give prompt logprobs (None: no such row)
    prompt_chunks: list[ScheduledChunk] = field(default_factory=list)  # their chunks, in row order
    #                                                                      (len(chunk.prompt_positions) rows each)


class LoneDecodeInputs:
    """The compiled graph's inputs for one request's decode step, kept from step to step and written in place
    through numpy views: four tensors built anew cost ~80 µs of a 4.4 ms SmolLM2 step (the interpreter's objects
    are cold after a step that streamed the weights). Steps run one at a time, so a step's inputs are no longer
    read when the next step's are written."""

    def __init__(self) -> None:
        self.ids, self.pos, self.slot = (np.zeros(1, dtype=np.int64) for _ in range(3))
        self.tensors = tuple(torch.from_numpy(a) for a in (self.ids, self.pos, self.slot))
        self._table = np.zeros(0, dtype=np.int64)
        self._views: dict[int, torch.Tensor] = {}  # [1, n] tensors over the first n entries of _table

    def table(self, block_ids: list[int], nb: int) -> torch.Tensor:
        """[1, max(nb, 2)]: the first nb blocks, then block 0 (a dynamic dimension of size 1 would be specialized)."""
        n = max(nb, 2)
        if n > len(self._table):
            self._table, self._views = np.zeros(max(2 * n, 64), dtype=np.int64), {}
        view = self._views.get(n)
        if view is None:
            view = self._views[n] = torch.from_numpy(self._table[:n]).view(1, n)
        self._table[:nb] = block_ids[:nb]
        self._table[nb:n] = 0
        return view


class ModelRunner:
    def __init__(self, model: Model, kv: KVCache, device: str | torch.device,
                 mirrors: tuple[KVCache, ...] = (), per_query: bool = False,
                 compiled: CompiledDecode | None = None) -> None:
        self.model = model
        self.compiled = compiled  # pure-decode steps of the batch sizes it accepts run as one compiled graph
        self.per_query = per_query  # batch-invariant attention (--deterministic)
        self.kv = kv
        self.mirrors = mirrors  # caches addressed by the same block ids (a draft model's): copied alike
        self.device = torch.device(device)
        self.block_size = kv.block_size
        self.window = model.config.sliding_window
        self._lone = LoneDecodeInputs()
        self._first_row = torch.zeros(1, dtype=torch.long, device=self.device)  # sample_rows of a one-row step
        # decodes read by kv/decode_attention.py's kernel: their blocks count as the ledger's direct reads, not as
        # view slots (counted twice, a batch-1 decode's gathered bytes came out negative)
        self._direct_decodes = decodes_in_place(kv.dtype, self.device.type)

    def prepare(self, sched: SchedulerOutput) -> ModelInput:
        """Split chunks into attention calls (engine/attention_calls.py: by query length, then by KV
        length so short contexts are not padded to long ones), build metadata on the CPU, move once."""
        for src, dst in sched.block_copies:
            for cache in (self.kv, *self.mirrors):
                cache.copy_block(src, dst)
        if len(sched.chunks) == 1 and self.compiled is not None and self.compiled.accepts(1):
            c = sched.chunks[0]
            if c.num_tokens == 1 == c.num_sampled:
                return self._lone_decode(c)
        bs = self.block_size
        calls = attention_calls([(c.num_tokens, c.start + c.num_tokens) for c in sched.chunks], bs)
        ids: list[int] = []
        pos: list[int] = []
        groups: list[AttnGroup] = []
        slot_parts: list[torch.Tensor] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prompt_rows: list[int] = []
        prompt_chunks: list[ScheduledChunk] = []
        shapes: list[tuple[int, list[int]]] = []
        single = len(calls) == 1
        # a pure-decode step the compiled graph takes: it builds its own masks and reads every block in place
        graph = self.compiled is not None and single and all(c.num_tokens == 1 == c.num_sampled for c in sched.chunks) \
            and self.compiled.accepts(len(sched.chunks))
        row = 0
        for call in calls:
            chunks = [sched.chunks[i] for i in call]
            q_len = chunks[0].num_tokens
            for c in chunks:
                ids += c.request.token_slice(c.start, c.start + q_len)
                pos += range(c.start, c.start + q_len)
                if c.num_sampled:
                    sample_rows += range(row + q_len - c.num_sampled, row + q_len)
                    sample_chunks.append(c)
                if c.prompt_positions:
                    prompt_rows += [row - c.start + i for i in c.prompt_positions]
                    prompt_chunks.append(c)
                row += q_len
            starts = torch.tensor([c.start for c in chunks])
            q_pos = starts[:, None] + torch.arange(q_len)  # [B, q_len]
            table = self._block_table([c.request.block_ids for c in chunks], int(q_pos.max()) + 1)
            slot_parts.append((table.gather(1, q_pos // bs) * bs + q_pos % bs).flatten())
            mask, local = (None, None) if graph else self._masks(q_pos, table.shape[1] * bs)
            n = len(chunks) * q_len
            idx = None if single else torch.arange(row - n, row)
            first = self._consecutive(chunks[0].request.block_ids, table.shape[1]) \
                if len(chunks) == 1 and not graph else None
            groups.append(AttnGroup(len(chunks), q_len, idx, table, mask, local, first))
            shapes.append((q_len, [c.start + q_len for c in chunks]))
        if graph:
            return self._compiled_input(ids, pos, slot_parts[0], groups[0].block_table, sample_chunks, shapes)
        in_place = self._direct_decodes  # queries the kernel reads (decodes; all under --deterministic): no views
        view_slots = sum(g.block_table.shape[1] * bs for g in groups
                         if g.block_start is not None and not (in_place and (g.q_len == 1 or self.per_query)))
        dev = self.device
        meta = AttentionMetadata(torch.tensor(pos, dtype=torch.long).to(dev), torch.cat(slot_parts).to(dev),
                                 [self._to(g) for g in groups], len(ids), self.per_query)
        rows = torch.tensor(prompt_rows, dtype=torch.long, device=dev) if prompt_rows else None
        return ModelInput(torch.tensor(ids, dtype=torch.long, device=dev), meta,
                          torch.tensor(sample_rows, dtype=torch.long, device=dev), sample_chunks, view_slots, shapes,
                          prompt_rows=rows, prompt_chunks=prompt_chunks)

    def forward(self, inp: ModelInput) -> torch.Tensor:
        """Run the model; return fp32 logits [N, vocab] for the sampling rows."""
        return self.forward_with_argmax(inp)[0]

    @torch.inference_mode()
    def forward_with_argmax(self, inp: ModelInput) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`forward`'s logits, each row's argmax where the compiled step computed it (else None), and the hidden
        states [M, hidden] of the prompt rows (else None: decoding/prompt_logprobs.py turns them into logprobs)."""
        if inp.decode is not None:
            return (*self.compiled.run(*inp.decode), None)
        hidden = self.model.forward(inp.input_ids, inp.meta, self.kv)
        prompt = None if inp.prompt_rows is None else hidden[inp.prompt_rows]
        return self.model.compute_logits(hidden[inp.sample_rows]), None, prompt

    def _lone_decode(self, c: ScheduledChunk) -> ModelInput:
        """One request's decode step for the compiled graph, written into LoneDecodeInputs from Python ints (the
        general path below builds it with a dozen small tensor ops)."""
        bs, pos, lone = self.block_size, c.start, self._lone
        lone.ids[0] = c.request.token_slice(pos, pos + 1)[0]
        lone.pos[0] = pos
        lone.slot[0] = c.request.block_ids[pos // bs] * bs + pos % bs
        decode = (*lone.tensors, lone.table(c.request.block_ids, pos // bs + 1))
        if self.device.type != "cpu":
            decode = tuple(t.to(self.device) for t in decode)
        view = 0 if self._direct_decodes else decode[3].shape[1] * bs
        return ModelInput(decode[0], None, self._first_row, [c], view, [(1, [pos + 1])], decode)

    def _compiled_input(self, ids: list[int], pos: list[int], slots: torch.Tensor, table: torch.Tensor,
                        chunks: list[ScheduledChunk], shapes: list[tuple[int, list[int]]]) -> ModelInput:
        """A pure-decode step for the compiled graph: no masks (built in the graph), the table padded to >= 2
        blocks (a dynamic dimension of size 1 would be specialized). Inductor fuses the table lookup into
        attention's reductions, so every key slot is read in place (the ledger's view slots)."""
        B, nb, dev = len(ids), table.shape[1], self.device
        padded = torch.cat([table, table.new_zeros(B, 2 - nb)], 1) if nb < 2 else table
        decode = (torch.tensor(ids, dtype=torch.long).to(dev), torch.tensor(pos, dtype=torch.long).to(dev),
                  slots.to(dev), padded.to(dev))
        view = 0 if self._direct_decodes else B * nb * self.block_size
        return ModelInput(decode[0], None, torch.arange(B, device=dev), chunks, view, shapes, decode)

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
