"""Beam search as the engine core runs it: a request with `use_beam_search` becomes a group of
`beam_width` sequences (Requests named `<id>#<k>`) scheduled like any other; beams that continue the
same parent share its KV blocks by fork (copy-on-write on the first write into a shared block).

The rule is transformers' `num_beams` (generation/utils.py, `_beam_search`, v5): each step, every
beam's log-softmax plus its running score, flattened; the top K = max(2, 1 + number of stop tokens) ×
W candidates; those that stop (a stop token, or the length limit) and rank among the first W become
finished hypotheses scored sum / generated_length ** length_penalty (the best W kept); the best W
that do not stop run on. The search ends when every candidate stops, or when the best running
score / generated_length ** length_penalty cannot beat the worst of W finished hypotheses
(early_stopping=False), or once W hypotheses are finished (early_stopping=True).

A group steps only when all its beams produced their row in the same forward; a beam whose siblings
were not scheduled (token budget, preemption) gives its row back and computes it again next step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenhaul.engine.messages import FinishedBeam, RequestDelta, Sample
from tokenhaul.engine.request import Request, Status
from tokenhaul.engine.scheduler import ScheduledChunk, Scheduler
from tokenhaul.errors import CapacityError, RequestError
from tokenhaul.kv.manager import KVHolder
from tokenhaul.sampling_params import SamplingParams

NEG = -1.0e9  # transformers' "impossible" score


@dataclass
class BeamGroup:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stops: set[int]  # tokens that finish a beam
    beams: list[Request]  # running, best first
    scores: torch.Tensor  # [len(beams)] fp32 running sums of logprobs
    hyp_tokens: list[list[int]]  # W finished slots (output tokens), best first
    hyp_scores: torch.Tensor  # [W] fp32; NEG-filled while empty
    hyp_done: list[bool]
    improvable: bool = True
    num_forks: int = 0

    @property
    def width(self) -> int:
        return self.params.beam_width


def step_group(g: BeamGroup, logits: torch.Tensor, max_model_len: int) -> tuple[list[int], list[int], bool]:
    """One beam step on g's state from logits [len(beams), V] fp32: updates scores and hypotheses;
    returns (parent beam index, token) of the W new beams and whether the search is done."""
    W, p = g.width, g.params
    V = logits.shape[-1]
    gen = len(g.beams[0].output_token_ids)  # every running beam has generated as many tokens
    logp = torch.log_softmax(logits.float(), -1) + g.scores[:, None]
    k = max(2, 1 + len(g.stops)) * W
    top, idx = torch.topk(logp.flatten(), min(k, logp.numel()))
    parents, tokens = (idx // V).tolist(), (idx % V).tolist()
    at_limit = gen + 1 >= p.max_tokens or len(g.prompt_token_ids) + gen + 1 >= max_model_len
    hits = torch.tensor([at_limit or t in g.stops for t in tokens])
    running = top + hits.float() * NEG
    nxt = torch.topk(running, W).indices
    # finished: only stopping candidates among the first W may enter the W hypothesis slots
    fin = top / ((gen + 1) ** p.length_penalty)
    if p.early_stopping and all(g.hyp_done):
        fin = fin + NEG
    fin = fin + (~(hits & (torch.arange(len(tokens)) < W))).float() * NEG
    merged = torch.cat([g.hyp_scores, fin])
    keep = torch.topk(merged, W).indices.tolist()
    cand = [g.beams[q].output_token_ids + [t] for q, t in zip(parents, tokens)]
    old_n = len(g.hyp_tokens)
    g.hyp_tokens = [g.hyp_tokens[i] if i < old_n else cand[i - old_n] for i in keep]
    g.hyp_done = [g.hyp_done[i] if i < old_n else bool(hits[i - old_n]) and i - old_n < W for i in keep]
    g.hyp_scores = merged[keep]
    g.scores = running[nxt]
    best = float(g.scores[0]) / ((gen + 1) ** p.length_penalty)
    worst = float(g.hyp_scores.min())
    g.improvable = g.improvable and any(best > (worst if d else NEG) for d in g.hyp_done)
    done = bool(hits.all()) or not g.improvable or (p.early_stopping and all(g.hyp_done))
    nxt_l = nxt.tolist()
    return [parents[i] for i in nxt_l], [tokens[i] for i in nxt_l], done


class BeamSearch:
    """The beam groups one core runs. It adds the first beam to the scheduler, takes the beams' rows
    out of each step's logits, and after the scheduler's update rebuilds the beams by fork/free."""

    def __init__(self, scheduler: Scheduler, max_model_len: int) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.max_model_len = max_model_len
        self.groups: dict[str, BeamGroup] = {}
        self.owner: dict[str, BeamGroup] = {}  # beam request id → its group

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            eos_token_ids: tuple[int, ...], priority: int) -> None:
        """Queue a beam search request: its first beam (the prompt) goes to the scheduler."""
        if request_id in self.groups:
            raise RequestError(f"duplicate request id {request_id!r}")
        total = min(len(prompt_token_ids) + params.max_tokens, self.max_model_len)
        need = self.kv.blocks_for_beams(len(prompt_token_ids), total, params.beam_width)
        if need > self.kv.num_blocks:  # all beams must fit at once, or the group could never step
            raise CapacityError(f"beam search needs {need} KV blocks ({params.beam_width} beams of {total} "
                                f"tokens) but the pool has only {self.kv.num_blocks}")
        if params.beam_width > self.scheduler.config.max_num_seqs:  # its beams must all run in one step
            raise CapacityError(f"beam_width {params.beam_width} exceeds the engine's max_num_seqs "
                                f"{self.scheduler.config.max_num_seqs}")
        if params.beam_width > self.scheduler.config.max_num_batched_tokens:  # ... and all get a row in it
            raise CapacityError(f"beam_width {params.beam_width} exceeds the engine's max_num_batched_tokens "
                                f"{self.scheduler.config.max_num_batched_tokens}")
        root = Request(f"{request_id}#0", list(prompt_token_ids), params, tuple(eos_token_ids), priority,
                       beam_group=request_id)
        self.scheduler.add(root)
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        W = params.beam_width
        g = BeamGroup(request_id, list(prompt_token_ids), params, stops, [root], torch.zeros(1),
                      [[] for _ in range(W)], torch.full((W,), NEG), [False] * W)
        self.groups[request_id] = g
        self.owner[root.request_id] = g

    def split(self, logits: torch.Tensor, chunks: list[ScheduledChunk]
              ) -> tuple[torch.Tensor, list[ScheduledChunk], dict[str, torch.Tensor]]:
        """Take the beams' rows (one per beam chunk) out of a step's logits [R, V]: returns the other
        rows, their chunks, and beam request id → row."""
        if not self.owner:
            return logits, chunks, {}
        keep_rows, keep_chunks, rows = [], [], {}
        r = 0
        for c in chunks:
            rid = c.request.request_id
            if rid in self.owner:
                rows[rid] = logits[r]
            else:
                keep_rows += range(r, r + c.num_sampled)
                keep_chunks.append(c)
            r += c.num_sampled
        return logits[keep_rows], keep_chunks, rows

    def step(self, rows: dict[str, torch.Tensor]) -> tuple[list[RequestDelta], list[Request]]:
        """Advance every group whose beams all produced a row: returns the deltas of finished groups
        (their best n beams) and the beam requests that ended (for observers)."""
        deltas, ended = [], []
        for g in {self.owner[rid].request_id: self.owner[rid] for rid in rows}.values():
            if not all(b.request_id in rows for b in g.beams):
                for b in g.beams:  # a sibling was not scheduled: give the row back, compute it again
                    if b.request_id in rows:
                        b.num_computed_tokens -= 1
                continue
            logits = torch.stack([rows[b.request_id] for b in g.beams])
            parents, tokens, done = step_group(g, logits, self.max_model_len)
            if done:
                deltas.append(self._finish(g))
                ended += self._drop(g, "stop")
            else:
                self._rebuild(g, parents, tokens)
        return deltas, ended

    def abort(self, request_id: str) -> list[Request]:
        """End a group now; returns its beam requests (their blocks are freed)."""
        g = self.groups.get(request_id)
        return [] if g is None else self._drop(g, "abort")

    def public_ids(self, ids: list[str]) -> list[str]:
        """Scheduler request ids with each group's beams shown once, as the group's id."""
        return [r for r in ids if r not in self.owner] + list(self.groups)

    def _rebuild(self, g: BeamGroup, parents: list[int], tokens: list[int]) -> None:
        """Beam i becomes beam parents[i] + tokens[i]: fork each parent's blocks, free the old beams,
        hand the forks over. Beams that descend from one parent share its blocks."""
        forks = []
        for q, t in zip(parents, tokens):
            f = KVHolder(g.prompt_token_ids + g.beams[q].output_token_ids + [t])
            self.kv.fork(g.beams[q], f)
            forks.append(f)
        for b in g.beams:
            self.kv.free(b)
        while len(g.beams) < g.width:
            root = g.beams[0]
            b = Request(f"{g.request_id}#{len(g.beams)}", g.prompt_token_ids, g.params, root.eos_token_ids,
                        root.priority, arrival=root.arrival, arrival_time=root.arrival_time, beam_group=g.request_id)
            g.beams.append(b)
            self.owner[b.request_id] = g
            self.scheduler.adopt(b)
        for b, f in zip(g.beams, forks):
            b.output_token_ids = f.token_ids[len(g.prompt_token_ids):]
            b.block_ids, b.block_hashes, b.num_computed_tokens = f.block_ids, f.block_hashes, f.num_computed_tokens
        g.num_forks += len(forks)

    def _finish(self, g: BeamGroup) -> RequestDelta:
        eos = () if g.params.ignore_eos else g.beams[0].eos_token_ids  # EOS first, as the scheduler checks
        best = [_ended(g, list(t), float(s), eos) for t, s in zip(g.hyp_tokens, g.hyp_scores.tolist())][:g.params.n]
        b = best[0]
        return RequestDelta(g.request_id, b.token_ids, True, b.finish_reason, [Sample(t) for t in b.token_ids], best,
                            b.stop_reason)

    def _drop(self, g: BeamGroup, reason: str) -> list[Request]:
        self.groups.pop(g.request_id, None)
        ended = []
        for b in g.beams:
            self.owner.pop(b.request_id, None)
            if b.status is not Status.FINISHED:
                self.scheduler.abort(b.request_id, reason)
            ended.append(b)
        return ended


def _ended(g: BeamGroup, tokens: list[int], score: float, eos: tuple[int, ...]) -> FinishedBeam:
    """A finished hypothesis: it ended at a stop token, or else at the length limit."""
    last = tokens[-1] if tokens else None
    stop_id = last if last in g.params.stop_token_ids and last not in eos else None
    return FinishedBeam(tokens, score, "stop" if last in g.stops else "length", stop_id)
