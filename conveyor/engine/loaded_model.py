"""``LoadedModel``: what loading a model gives an engine (the model, its ``ModelInfo``, its tokenizer), and the
draft model that speculative decoding's method "draft_model" proposes with."""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

from conveyor.engine.args import EngineArgs

logger = logging.getLogger("conveyor.engine")


class LoadedModel(NamedTuple):
    """A loaded model (``torch.nn.Module``), its ``models.ModelInfo`` and tokenizer. Engines that compare
    configurations in one process share one (``LLMEngine.sharing_model``)."""

    model: Any
    info: Any
    tokenizer: Any

    @classmethod
    def load(cls, args: EngineArgs, device: str) -> LoadedModel:
        from conveyor.models.loader import load_model
        from conveyor.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(args.model)
        model, info = load_model(args.model, dtype=args.dtype, device=device, seed=args.seed,
                                 quantization=args.quantization, convert=args.convert,
                                 pooler_config=args.pooler_overrides())
        logger.info("model %s, dtype %s (%s)", info.name, info.dtype, info.dtype_reason)
        return cls(model, info, tokenizer)


def load_draft(args: EngineArgs, device: str, target_info, max_model_len: int) -> tuple[Any, Any] | None:
    """The draft model of ``--speculative-config``'s method "draft_model" (model, info), else None. Its proposals
    are target token ids, so both must share the vocabulary, and it must reach the context."""
    from conveyor.core.speculative import SpeculativeConfig
    from conveyor.models.loader import load_model

    spec = SpeculativeConfig.parse(args.speculative_config)
    if spec is None or not spec.proposes_in_executor:
        return None
    model, info = load_model(spec.model, dtype=args.dtype, device=device, seed=args.seed)
    if info.vocab_size != target_info.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({info.vocab_size} tokens) is not the target's "
                         f"({target_info.vocab_size}): proposals are token ids of one vocabulary")
    if info.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model's context ({info.max_position_embeddings}) is shorter than "
                         f"max_model_len ({max_model_len})")
    logger.info("speculative draft model %s, dtype %s", info.name, info.dtype)
    return model, info
