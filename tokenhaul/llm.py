"""LLM: the offline Python API — `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch
from tqdm import tqdm

from tokenhaul.config import engine_config
from tokenhaul.decoding.grammar import GrammarCompiler
from tokenhaul.engine.core import EngineCore
from tokenhaul.engine.heap import frozen_heap
from tokenhaul.errors import ModelError, RequestError
from tokenhaul.kv.cache import KVCache
from tokenhaul.kv.manager import KVHolder
from tokenhaul.layers.linear import Linear
from tokenhaul.layers.linear_dense import DenseLinear
from tokenhaul.ledger.costs import ModelCosts
from tokenhaul.ledger.ledger import Ledger
from tokenhaul.models.catalog import DEFAULT_MODEL, resolve
from tokenhaul.models.registry import Model, load_model
from tokenhaul.outputs import BeamOutput, CompletionOutput, LogprobDict, RequestOutput, vllm_logprobs
from tokenhaul.sampling_params import SamplingParams, truncate_prompt
from tokenhaul.text.output_processor import OutputProcessor
from tokenhaul.text.tokenizer import Tokenizer
from tokenhaul.whatif.calibrate import machine_roofline

Prompt = str | list[int] | dict  # dict: vLLM's TextPrompt {"prompt"} or TokensPrompt {"prompt_token_ids"}


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, seed: int | None = None, **engine_kwargs) -> None:
        """engine_kwargs: EngineConfig's fields (or vLLM's names for them, config.engine_config); seed (vLLM's):
        seeds the sampling of requests without a seed of their own (torch's global generator)."""
        self.files = resolve(model)
        self.config = engine_config(model, **engine_kwargs)
        if seed is not None:
            torch.manual_seed(seed)
        if self.config.threads:
            torch.set_num_threads(self.config.threads)
        self.model = load_model(self.files.gguf_path, self.config.torch_dtype, self.config.device,
                                self.config.max_model_len, self.config.quantization,
                                self.files.cache_dir, self.config.deterministic)  # first: rejects unsupported archs
        context = self.model.config.max_position
        if engine_kwargs.get("max_model_len") is not None and self.config.max_model_len > context:
            # as vLLM: a length the model was not trained for is refused, not capped silently (the default is capped)
            raise ModelError(f"max_model_len {self.config.max_model_len} exceeds the model's context of {context} "
                             f"tokens; give at most {context}")
        self.tokenizer = Tokenizer.from_gguf(self.files.gguf_path, self.files.cache_dir, self.files.name)
        self.draft_model, draft_dense = self._load_draft(self.config.draft_model) if self.config.draft_model else (
            None, None)
        if self.config.sparsity:
            self._sparsify()
        centers = self._key_centers() if self.config.kv_torch_dtype == torch.int8 else None
        self.grammars = grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.model.config.vocab_size)
        self.core = EngineCore(self.config, self.model, draft_model=self.draft_model, draft_prefill_model=draft_dense,
                               key_centers=centers, grammars=grammars)
        self.costs = ModelCosts.from_model(
            self.model, KVCache.bytes_per_value(self.config.kv_torch_dtype, self.model.config.head_dim),
            self.config.deterministic)
        self._ids = itertools.count()

    def _sparsify(self) -> None:
        """Swap the sparse linears in before the engine core is built (its compiled decode step traces them).
        Thresholds come from the model's cache dir, or are calibrated on the dense model by an eager scratch core."""
        from tokenhaul.layers.linear_sparse import sparsify
        from tokenhaul.layers.sparse_calibration import is_calibrated, load_or_calibrate

        c = self.config
        if not is_calibrated(self.files.cache_dir, c.sparsity):
            self.core = EngineCore(dataclasses.replace(c, compile="off", sparsity=0.0, itl_target_ms=0.0), self.model)
        sparsify(self.model, load_or_calibrate(self, c.sparsity), c.sparsity)
        self.core = None

    def _key_centers(self) -> torch.Tensor:
        """The int8 key cache's centers (kv/key_centers.py), from the model's cache dir, or calibrated now by an eager
        scratch core with a float KV cache of a few blocks."""
        from tokenhaul.kv.key_centers import calibrate_and_save, saved

        centers = saved(self.files.cache_dir)
        if centers is None:
            c = self.config
            blocks = -(-1024 // c.block_size)  # room for one 512-token window, twice over
            self.core = EngineCore(dataclasses.replace(c, compile="off", kv_dtype="auto", itl_target_ms=0.0,
                                                       num_kv_blocks=blocks), self.model)
            centers = calibrate_and_save(self)
            self.core = None
        return centers

    def _load_draft(self, alias: str) -> tuple[Model, Model | None]:
        """Load a draft model and refuse it unless its tokenizer is the target's, token for token. A packed
        draft also comes dense, for its prompt catch-up (decoding/speculative.py); else the second is None."""
        files = resolve(alias)
        tok = Tokenizer.from_gguf(files.gguf_path, files.cache_dir, files.name)
        if tok.backend.get_vocab(with_added_tokens=True) != self.tokenizer.backend.get_vocab(with_added_tokens=True):
            raise ModelError(f"draft model {alias!r} has another vocabulary than {self.config.model!r}: "
                             f"speculation needs the same tokenizer")
        c = self.config

        def load(quantization: str) -> Model:
            return load_model(files.gguf_path, c.torch_dtype, c.device, c.max_model_len, quantization, files.cache_dir,
                              c.deterministic)

        draft = load(c.draft_quant)
        packed = any(isinstance(v, Linear) and not isinstance(v, DenseLinear)
                     for layer in getattr(draft, "layers", []) for v in vars(layer).values())
        return draft, (load("none") if packed else None)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, dict):
            prompt = _prompt_of(prompt)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            return self.tokenizer.encode(prompt)
        if not prompt:
            raise RequestError("prompt is empty")
        self.core.limits().check_token_ids(prompt)
        return list(prompt)

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False, *,
                 fork_from: list[KVHolder | None] | None = None,
                 keep_kv: list[KVHolder | None] | None = None) -> list[RequestOutput]:
        """Run every prompt through the engine core together; one output per prompt, in prompt order. fork_from /
        keep_kv (per prompt, for tree search): start from KV held there; keep the KV when done (core.release).
        `sampling_params`: one for all prompts or one per prompt (vLLM's name and meaning). n > 1 samples run as
        n engine requests, sample i seeded seed + i as the HTTP server seeds its choices (see _fan_out), so the
        two agree; their outputs fold back into the prompt's RequestOutput.outputs. use_tqdm (vLLM's; off by
        default here): a progress bar of finished requests on stderr."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise RequestError(f"{len(plist)} sampling params for {len(prompts)} prompts: give one, or one per prompt")
        ledger = Ledger(self.costs, roofline=lambda: machine_roofline(self.costs.device))
        self.core.observer = ledger
        frontend = OutputProcessor(self.tokenizer, ledger)
        eos = tuple(self.tokenizer.eos_token_ids)
        ids = []  # every engine request of the call
        groups = []  # per prompt: its request id and its engine requests' ids
        try:
            for i, (prompt, p) in enumerate(zip(prompts, plist)):
                rid = f"gen-{next(self._ids)}"
                token_ids = self.encode(prompt)
                token_ids = truncate_prompt(token_ids, p.truncate_prompt_tokens, self.config.max_model_len)
                fan = _fan_out(p)
                for sp in fan:
                    if sp.bad_words:
                        sp.update_from_tokenizer(lambda t: self.tokenizer.encode(t, add_special_tokens=False))
                if len(fan) > 1 and keep_kv and keep_kv[i] is not None:
                    raise RequestError(f"n={p.n} samples cannot keep their KV in one keep_kv holder")
                sample_ids = [rid] if len(fan) == 1 else [f"{k}_{rid}" for k in range(len(fan))]  # vLLM's child ids
                groups.append((rid, sample_ids))
                for sid, sp in zip(sample_ids, fan):
                    ids.append(sid)  # before it is added: a failure below aborts it with the others
                    self.core.add_request(sid, token_ids, sp, eos, fork_from=fork_from[i] if fork_from else None,
                                          keep_kv=keep_kv[i] if keep_kv else None)
                    frontend.add(sid, token_ids, sp)
            with frozen_heap(), tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
                while self.core.has_unfinished():
                    step = self.core.num_steps
                    updated, stopped = frontend.process(self.core.step(), step)
                    for rid in stopped:
                        self.core.abort(rid, "stop")
                    bar.update(sum(o.finished for o in updated))
        except BaseException:
            for rid in ids:
                self.core.abort(rid)
            raise
        finally:
            self.core.observer = None
        text = _TokenText(self.tokenizer)
        outs = [_fold(rid, [frontend.release(s) for s in sample_ids], p, text)
                for (rid, sample_ids), p in zip(groups, plist)]
        for o, prompt in zip(outs, prompts):
            o.ledger = ledger
            o.prompt = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        return outs

    def prepare_structured_outputs(self) -> None:
        """Build llguidance's token table now (~0.13 s SmolLM2, ~1.1 s Gemma3, GIL held) rather than inside the
        first constrained request's step, where it stalls every other stream; `serve` calls this at start."""
        self.grammars.warm()

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's accessor): encode, decode, apply_chat_template."""
        return self.tokenizer

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate (vLLM's
        arguments: chat_template_kwargs are variables for the template)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, continue_final_message,
                                                      chat_template_kwargs) for c in convs]
        outs = self.generate([self.tokenizer.encode(p, add_special_tokens=False) for p in prompts], sampling_params,
                             use_tqdm)
        for o, prompt in zip(outs, prompts):
            o.prompt = prompt  # the rendered chat, as vLLM's
        return outs


def _prompt_of(prompt: dict) -> str | list[int]:
    """vLLM's prompt dicts: {"prompt_token_ids": [...]} (TokensPrompt) or {"prompt": "..."} (TextPrompt)."""
    if "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt.get("prompt"), str):
        return prompt["prompt"]
    raise RequestError(f"a prompt dict needs 'prompt' (text) or 'prompt_token_ids', got keys {sorted(prompt)}")


def _fan_out(p: SamplingParams) -> list[SamplingParams]:
    """The engine requests of one prompt: one, or with n > 1 samples one per sample, n=1 and sample i seeded
    (seed + i) mod 2**63, as the HTTP server seeds choice i (server/protocol.py); prompt logprobs are asked of
    sample 0 only (the same prompt for all). A beam search is one request."""
    if p.n == 1 or p.use_beam_search:
        return [p]
    return [dataclasses.replace(p, n=1, seed=None if p.seed is None else (p.seed + i) % 2**63,
                                prompt_logprobs=p.prompt_logprobs if i == 0 else None)  # one prompt: once
            for i in range(p.n)]


def _fold(request_id: str, samples: list[RequestOutput], p: SamplingParams, text: _TokenText) -> RequestOutput:
    """One prompt's output: its first sample's (its text, token_ids, ... are outputs[0]'s) under the prompt's
    request id, with every sample, or every returned beam, in outputs. Logprobs and prompt logprobs leave the front
    end's TokenLogprobs for vLLM's dicts (outputs.vllm_logprobs)."""
    out = samples[0]
    if out.prompt_logprobs is not None:
        out.prompt_logprobs = vllm_logprobs(out.prompt_logprobs, text)
    if out.beams is not None:
        out.outputs = [_beam_output(k, b, p) for k, b in enumerate(out.beams)]
    else:
        for s in samples:
            if s.logprobs is not None:
                s.logprobs = vllm_logprobs(s.logprobs, text)
        out.outputs = [CompletionOutput(k, s.text, s.token_ids, _sum_logprobs(s.logprobs, s.token_ids), s.logprobs,
                                        s.finish_reason, s.stop_reason) for k, s in enumerate(samples)]
    out.request_id = request_id
    return out


def _beam_output(index: int, beam: BeamOutput, p: SamplingParams) -> CompletionOutput:
    """A returned beam; cumulative_logprob is its score undone of length_penalty, the sum of its logprobs."""
    total = beam.score * len(beam.token_ids) ** p.length_penalty
    return CompletionOutput(index, beam.text, list(beam.token_ids), total, None, beam.finish_reason, beam.stop_reason)


def _sum_logprobs(logprobs: list[LogprobDict] | None, token_ids: list[int]) -> float | None:
    return None if logprobs is None else sum(d[t].logprob for d, t in zip(logprobs, token_ids))


class _TokenText:
    """A token id's decoded_token (vLLM's: the tokenizer's decode of that one id, special tokens shown), each id
    decoded once per generate call."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self.texts.get(token_id)
        if s is None:
            s = self.texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return s
