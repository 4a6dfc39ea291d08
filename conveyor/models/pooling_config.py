"""What a pooling model returns and how: read from sentence-transformers' files beside the checkpoint
(``modules.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``, ``config_sentence_transformers.json``), a
GGUF file's ``{arch}.pooling_type``, the architecture (a model without a language-model head), and the
``--pooler-config`` / ``--convert`` flags, as vLLM recognises pooling models.

A model is one of three tasks: ``generate`` (a causal LM), ``embed`` (a vector per input: pooled hidden states,
optionally L2-normalised, optionally cut to fewer dimensions) or ``score`` (a relevance score per (query, document)
pair: a cross-encoder's classifier, or a decoder reranker's yes/no logits as Qwen3-Reranker scores). What
sentence-transformers would compute differently (max pooling, a Dense layer after pooling, prompts left out of the
pooling) is refused, naming the file and field.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace

POOLING_TYPES = ("mean", "cls", "last")
TASKS = ("generate", "embed", "score")
CONVERT_CHOICES = ("auto", "none", "embed", "classify")
# GGUF {arch}.pooling_type (llama.cpp's enum): 0 none, 1 mean, 2 cls, 3 last, 4 rank
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}
# Qwen3-Reranker's prompt (its model card), for a decoder that scores with classifier_from_token: the judgement
# is the logit of "yes" against "no" at the last token
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
    "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n"
    "<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}<|im_end|>\n"
    "<|im_start|>assistant\n<think>\n\n</think>\n\n")
QWEN3_RERANKER_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_ST_MODULES = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
               "sentence_transformers.models.Normalize"}


@dataclass(frozen=True)
class PoolingConfig:
    """How a pooling model turns hidden states into its result (module doc).

    ``pooling_type``: which rows (mean of every token, the first token, the last token); ``normalize``: L2 over
    the vector (embed); ``dimensions``: the default length of an embedding (None: the model's whole hidden size);
    ``matryoshka``: the lengths a request may ask for (() none but the full one, None any up to the full one);
    ``max_seq_length``: sentence-transformers' input limit; ``classifier_from_token``: a decoder reranker's
    (no, yes) tokens; ``score_template``: how a (query, document) pair becomes one prompt for such a decoder
    (None: the pair encoded as two segments, as a cross-encoder takes it)."""

    task: str
    pooling_type: str
    normalize: bool = False
    dimensions: int | None = None
    matryoshka: tuple[int, ...] | None = ()
    max_seq_length: int | None = None
    classifier_from_token: tuple[str, str] | None = None
    score_template: str | None = None
    sources: tuple[str, ...] = field(default=(), compare=False)  # where each setting came from, for the start-up log

    def describe(self) -> str:
        what = f"{self.task}: {self.pooling_type} pooling"
        if self.task == "embed":
            what += ", normalized" if self.normalize else ", not normalized"
        return what + (f" ({'; '.join(self.sources)})" if self.sources else "")


def _read(path: str) -> dict | list | None:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def sentence_transformers_config(model_dir: str) -> dict:
    """The settings sentence-transformers' files beside a checkpoint give: pooling_type, normalize,
    max_seq_length, dimensions (its ``truncate_dim``); {} without a modules.json. ValueError naming the file and
    field for what it would compute that conveyor does not."""
    modules = _read(os.path.join(model_dir, "modules.json"))
    if modules is None:
        return {}
    where = os.path.join(model_dir, "modules.json")
    out: dict = {"normalize": False}
    for module in modules:
        kind = module.get("type", "")
        if kind not in _ST_MODULES:
            raise ValueError(f"{where}: module {kind!r} is not computed (conveyor computes a Transformer, its "
                             "Pooling and Normalize); the model is refused rather than embedded differently")
        if kind.endswith(".Normalize"):
            out["normalize"] = True
        elif kind.endswith(".Pooling"):
            out["pooling_type"] = _st_pooling(os.path.join(model_dir, module.get("path", ""), "config.json"))
    bert = _read(os.path.join(model_dir, "sentence_bert_config.json")) or {}
    if bert.get("max_seq_length"):
        out["max_seq_length"] = int(bert["max_seq_length"])
    st = _read(os.path.join(model_dir, "config_sentence_transformers.json")) or {}
    if st.get("truncate_dim"):
        out["dimensions"] = int(st["truncate_dim"])
    return out


def _st_pooling(path: str) -> str:
    cfg = _read(path)
    if cfg is None:
        raise ValueError(f"{path}: missing (modules.json names a Pooling module)")
    if "pooling_mode" in cfg:  # newer sentence-transformers writes the mode by name
        mode = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(cfg["pooling_mode"])
        if mode is None:
            raise ValueError(f"{path}: pooling_mode={cfg['pooling_mode']!r} is not computed (mean, cls, lasttoken)")
        return mode
    if cfg.get("include_prompt") is False:
        raise ValueError(f"{path}: include_prompt=false (the prompt's tokens left out of the pooling) is not computed")
    modes = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls", "pooling_mode_lasttoken": "last"}
    chosen = [ours for key, ours in modes.items() if cfg.get(key)]
    others = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v and k not in modes]
    if others or len(chosen) != 1:
        raise ValueError(f"{path}: pooling {', '.join(others + [k for k in modes if cfg.get(k)]) or 'none'} is not "
                         "computed: exactly one of mean, cls or lasttoken")
    return chosen[0]


def matryoshka_of(raw: dict) -> tuple[int, ...] | None:
    """The embedding lengths a model's config.json declares it was trained to be cut to (``matryoshka_dimensions``,
    or ``is_matryoshka``: any), () for none, as vLLM reads them."""
    if raw.get("matryoshka_dimensions"):
        return tuple(int(d) for d in raw["matryoshka_dimensions"])
    return None if raw.get("is_matryoshka") else ()


def choose_task(architecture: str, causal: bool, num_labels: int, has_st_files: bool, convert: str) -> str:
    """The task a model serves: what ``--convert`` asks, else what its checkpoint says (a classifier head: score;
    an encoder, an architecture without a language-model head, or sentence-transformers' files: embed)."""
    if convert not in CONVERT_CHOICES:
        raise ValueError(f"convert must be one of {', '.join(CONVERT_CHOICES)}, got {convert!r}")
    if convert == "none":
        if not causal:
            raise ValueError(f"{architecture} is an encoder: it embeds or scores, it cannot generate")
        return "generate"
    if convert in ("embed", "classify"):
        if convert == "classify" and not num_labels and not causal:
            raise ValueError(f"--convert classify: {architecture} has no classifier head")
        return "embed" if convert == "embed" else "score"
    if num_labels:
        return "score"
    lm_head_less = not architecture.endswith(("ForCausalLM", "LMHeadModel"))
    return "embed" if (not causal or lm_head_less or has_st_files) else "generate"


def pooling_config(task: str, causal: bool, st: dict, overrides: dict | None, gguf_pooling: int | None = None,
                   matryoshka: tuple[int, ...] | None = (), sources: tuple[str, ...] = ()) -> PoolingConfig | None:
    """The PoolingConfig of a pooling model (None for ``generate``): sentence-transformers' settings (``st``), a
    GGUF's pooling type, then ``overrides`` (``--pooler-config``: pooling_type, normalize, dimensions,
    matryoshka_dimensions, classifier_from_token, score_template). Defaults as vLLM's: an encoder pools by CLS,
    a decoder by its last token (the only token that saw them all); embeddings are normalised."""
    if task == "generate":
        return None
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - {"pooling_type", "normalize", "dimensions", "matryoshka_dimensions",
                                       "classifier_from_token", "score_template"})
    if unknown:
        raise ValueError(f"--pooler-config: unknown keys {unknown}")
    normalize = st.get("normalize", True)  # GGUF: llama.cpp's server normalises by default
    pooling = st.get("pooling_type") or _GGUF_POOLING.get(gguf_pooling or 0) or ("cls" if not causal else "last")
    cfg = PoolingConfig(task=task, pooling_type=pooling, normalize=normalize, dimensions=st.get("dimensions"),
                        matryoshka=matryoshka, max_seq_length=st.get("max_seq_length"), sources=sources)
    if "pooling_type" in overrides:
        overrides["pooling_type"] = str(overrides["pooling_type"]).lower()
        if overrides["pooling_type"] not in POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling_type must be one of {POOLING_TYPES}")
    if "matryoshka_dimensions" in overrides:
        dims = overrides.pop("matryoshka_dimensions")
        overrides["matryoshka"] = None if dims is True else tuple(int(d) for d in dims or ())
    if overrides.get("classifier_from_token") is not None:
        tokens = overrides["classifier_from_token"]
        if len(tokens) != 2:
            raise ValueError("--pooler-config: classifier_from_token is two tokens, (no, yes)")
        overrides["classifier_from_token"] = tuple(tokens)
    cfg = replace(cfg, **overrides)
    if cfg.classifier_from_token and cfg.score_template is None:
        cfg = replace(cfg, score_template=QWEN3_RERANKER_TEMPLATE)
    if task == "score" and causal and not cfg.classifier_from_token:
        raise ValueError("a decoder scores through two of its tokens: pass --pooler-config "
                         "'{\"classifier_from_token\": [\"no\", \"yes\"]}' (Qwen3-Reranker)")
    return cfg
