"""``LLM``: the offline API, shaped like vLLM's: ``LLM(model=...).generate(prompts, sampling_params)``."""

from __future__ import annotations

from collections.abc import Sequence

from tqdm.auto import tqdm

from conveyor.core.sampling_params import SamplingParams
from conveyor.engine.args import EngineArgs
from conveyor.engine.chat import Conversation, as_conversations, render_chat
from conveyor.engine.llm_engine import LLMEngine, PromptType
from conveyor.engine.outputs import RequestOutput
from conveyor.structured.grammars import grammar_text


class LLM:
    """Offline batch generation. Keyword arguments are ``EngineArgs`` fields (``max_num_seqs``, ``policy``, ...)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate completions for every prompt; returns ``RequestOutput``s in input order.

        A prompt is a string, a list of token ids, or ``{"prompt_token_ids": [...]}``. ``sampling_params`` is
        one for all prompts or one per prompt. A bad prompt raises ValueError before anything is queued.
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
        engine = self.engine
        tokenized = [engine.tokenize_prompt(prompt) for prompt in prompts]
        for (_, token_ids), p in zip(tokenized, params):  # validate all first: a bad one must strand no others
            engine.validate_prompt(token_ids, p)
            if p.structured_outputs is not None:
                grammar_text(p.structured_outputs)  # ValueError for a constraint that cannot be enforced
        ids = [
            engine.add_request(None, {"prompt": text, "prompt_token_ids": token_ids}, p)
            for (text, token_ids), p in zip(tokenized, params)
        ]
        results: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        bar.update(1)
        return [results[i] for i in ids]

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
