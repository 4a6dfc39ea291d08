"""``LLM``: the offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from tqdm.auto import tqdm

from conveyor.core.lora_request import LoRARequest
from conveyor.core.pooling_params import PoolingParams
from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.chat import Conversation, as_conversations, render_chat
from conveyor.engine.llm_engine import LLMEngine, PromptType
from conveyor.engine.outputs import EmbeddingOutput, PoolingRequestOutput, RequestOutput, ScoringOutput
from conveyor.engine.pooling import embed_prompt, score_prompt, truncation
from conveyor.structured.grammars import grammar_text


class LLM:
    """Offline batch generation. Keyword arguments are ``EngineArgs`` fields (``max_num_seqs``, ``policy``, ...)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._checked_loras: set[LoRARequest] = set()

    def _with_lora(self, params: list[SamplingParams],
                   lora_request: LoRARequest | Sequence[LoRARequest | None] | None) -> list[SamplingParams]:
        """``params`` with each prompt's adapter (vLLM's ``lora_request``: one for all or one per prompt), each
        adapter read and checked once (a ValueError naming why it is refused)."""
        if lora_request is None:
            return params
        loras = [lora_request] * len(params) if isinstance(lora_request, LoRARequest) else list(lora_request)
        if len(loras) != len(params):
            raise ValueError(f"got {len(loras)} lora_requests for {len(params)} prompts")
        from conveyor.models.lora_format import check_adapter

        for lora in loras:
            if lora is not None and lora not in self._checked_loras:
                if not self.engine.args.enable_lora:
                    raise ValueError("lora_request: this LLM serves no LoRA adapter (pass enable_lora=True)")
                check_adapter(lora.lora_path, self.engine.model_info.lora_base, self.engine.args.max_lora_rank)
                self._checked_loras.add(lora)
        return [p if lora is None else replace(p, lora=lora) for p, lora in zip(params, loras)]

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; returns ``RequestOutput``s in input order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``. ``sampling_params`` is
        one for all prompts or one per prompt; ``lora_request`` (with ``enable_lora=True``) the LoRA adapter,
        one for all or one per prompt (None: the base model). A bad prompt or adapter raises ValueError before
        anything is queued.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        params = self._with_lora(params, lora_request)
        engine = self.engine
        tokenized = [engine.tokenize_prompt(prompt) for prompt in prompts]
        for (_, token_ids), p in zip(tokenized, params):  # validate all first: a bad one must strand no others
            engine.validate_prompt(token_ids, p)
            if p.structured_outputs is not None:
                grammar_text(p.structured_outputs)  # ValueError for a constraint that cannot be enforced
        return self._run([{"prompt": text, "prompt_token_ids": token_ids} for text, token_ids in tokenized], params,
                         "generate", use_tqdm)

    def _run(self, prompts: list[dict], params: list[SamplingParams], desc: str,
             use_tqdm: bool) -> list[RequestOutput]:
        """Queue every (checked) prompt, step until all finished; their outputs in order."""
        engine = self.engine
        ids = [engine.add_request(None, prompt, p) for prompt, p in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc=desc, unit="req", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

    def embed(self, prompts: str | list[int] | Sequence[str | list[int]], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None) -> list[PoolingRequestOutput]:
        """Embeddings of texts (or token id lists), as vLLM's ``LLM.embed``: ``out.outputs.embedding`` each, in
        order. ``truncate_prompt_tokens`` cuts inputs to that many tokens (-1: the model's limit) instead of
        refusing them; ``pooling_params`` sets ``dimensions`` / ``normalize``."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        engine, params = self.engine, pooling_params or PoolingParams()
        keep = truncation(truncate_prompt_tokens, engine.max_model_len)
        token_lists = [embed_prompt(self.tokenizer, p, keep) for p in prompts]
        outs = self._pool(token_lists, [replace(params, task="embed")] * len(token_lists), "embed", use_tqdm)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.pooled)) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, instruction: str | None = None) -> list[PoolingRequestOutput]:
        """Relevance scores of (data_1, data_2) pairs, as vLLM's ``LLM.score``: one query against many documents,
        or pairs position by position; ``out.outputs.score`` each, in order. ``instruction``: a decoder
        reranker's task line (its template's {instruction})."""
        queries = [data_1] if isinstance(data_1, str) else list(data_1)
        documents = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(queries) == 1:
            queries = queries * len(documents)
        if len(queries) != len(documents):
            raise ValueError(f"score: {len(queries)} queries for {len(documents)} documents (give one query, or "
                             "one per document)")
        engine = self.engine
        keep = truncation(truncate_prompt_tokens, engine.max_model_len)
        pairs = [score_prompt(self.tokenizer, engine.model_info, q, d, keep, instruction)
                 for q, d in zip(queries, documents)]
        outs = self._pool([ids for ids, _ in pairs], [PoolingParams(task="score", pair_start=start)
                                                      for _, start in pairs], "score", use_tqdm)
        return [PoolingRequestOutput(o.request_id, o.prompt_token_ids, ScoringOutput(o.pooled[0])) for o in outs]

    def _pool(self, token_lists: list[list[int]], pooling: list[PoolingParams], desc: str,
              use_tqdm: bool) -> list[RequestOutput]:
        params = [SamplingParams(max_tokens=1, pooling=p) for p in pooling]
        for ids, p in zip(token_lists, params):  # all checked first: a bad one must strand no others
            self.engine.validate_prompt(ids, p)
        outs = self._run([{"prompt_token_ids": ids} for ids in token_lists], params, desc, use_tqdm)
        for out in outs:
            if out.error is not None or out.pooled is None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error or 'no result'}")
        return outs

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a batch of them, as vLLM's ``LLM.chat``.

        ``messages`` is ``[{"role": ..., "content": ...}, ...]`` or a list of such lists (batched in one run).
        Each is rendered with the model's chat template (or ``chat_template``), the assistant's turn opened when
        ``add_generation_prompt``; generation stops at the model's end-of-turn token (its EOS, e.g.
        ``<|im_end|>`` for SmolLM2). Returns one ``RequestOutput`` per conversation, in order.
        """
        prompts = [{"prompt_token_ids": render_chat(self.tokenizer, conv, add_generation_prompt, chat_template)}
                   for conv in as_conversations(messages)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
