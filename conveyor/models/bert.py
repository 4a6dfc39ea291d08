"""BERT-family encoders: bidirectional attention, learned absolute positions, token types, exact (erf) GELU and
post-norm layers, as ``BertModel`` computes them. all-MiniLM-L6-v2, BGE and E5 (v1/v2) checkpoints are this layout;
``RobertaModel`` / ``XLMRobertaModel`` (multilingual E5) differ only in where positions start. A
``*ForSequenceClassification`` checkpoint (a cross-encoder reranker) adds BERT's pooler (dense + tanh on [CLS]) and a
classifier.

An encoder holds no KV cache: a request's whole sequence runs in one step (its keys are every token's, so a chunk
cannot be computed before the tokens after it exist). A step's sequences are packed back to back on one token axis
without padding (``seq_starts``: where each begins, as flash-attention's ``cu_seqlens``): the embeddings, every
linear layer, GELU and LayerNorm run on the packed [T, hidden] rows at once; attention keeps each sequence to its
own rows (``layers.attention.packed``: one native call for the whole step where the CPU kernels serve, else one SDPA
call per sequence), reading q, k and v as views of the fused qkv output and writing its result straight into the
[T, heads, head_dim] rows the output projection reads. No pad token of any sequence is
computed; the token axis is rounded up once to the row count the prepacked GEMMs run (``padded_rows``, at most
1/16 more rows), so no layer copies its input to pad it, and GELU and the residual adds run in the GEMMs' epilogue
(``layers.linear.linear_gelu`` / ``linear_add``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from conveyor.layers.attention.packed import PackedSequences, packed_attention
from conveyor.layers.embedding import Embedding
from conveyor.layers.linear import linear_add, linear_gelu, padded_rows
from conveyor.models import gguf_config
from conveyor.models.config import ModelConfig
from conveyor.models.family import ModelFamily
from conveyor.models.gguf_file import GGUFError
from conveyor.models.hf_config import HFConfig
from conveyor.models.weights import WeightTarget

_QKV = ("query", "key", "value")


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)  # HF's query, key, value, fused at load
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.kernels = None  # native CPU kernels for the attention (models.cpu_layout.prepare_for_cpu)

    def forward(self, x: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
        rows = x.shape[0]  # seqs.starts[-1] real rows, then the encoder's padding rows
        qkv = self.qkv(x).view(rows, 3, self.num_heads, self.head_dim)
        out = torch.empty(rows, self.num_heads, self.head_dim, dtype=x.dtype, device=x.device)
        out[seqs.starts[-1]:].zero_()  # padding rows: finite, whatever they hold (every later op is row by row)
        packed_attention(qkv, out, seqs, self.kernels)
        return self.norm(linear_add(self.dense, out.view(rows, -1), x))  # post-norm: residual, then LayerNorm


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = BertSelfAttention(cfg)
        self.intermediate = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.output = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.output_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)

    def forward(self, x: torch.Tensor, seqs: PackedSequences) -> torch.Tensor:
        h = self.attention(x, seqs)
        return self.output_norm(linear_add(self.output, linear_gelu(self.intermediate, h), h))


class BertEncoder(nn.Module):
    """forward(input_ids[T], positions[T], token_type_ids[T], seq_starts) -> hidden [T, hidden] (module doc);
    ``classify(cls_hidden[R, hidden]) -> logits[R, num_labels]`` for a classification checkpoint."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.word_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = Embedding(cfg.max_position_embeddings + cfg.position_offset, cfg.hidden_size)
        self.token_type_embeddings = Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.embeddings_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.layers = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_layers))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if cfg.num_labels else None
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_labels) if cfg.num_labels else None
        self.native_stack = None  # the native layer stack computes decoders only

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor,
                seq_starts: list[int]) -> torch.Tensor:
        tokens = input_ids.shape[0]
        pad = padded_rows(tokens) - tokens  # rows the prepacked GEMMs run anyway: padded once here, not per layer
        if pad:
            input_ids, positions, token_type_ids = (F.pad(t, (0, pad)) for t in (input_ids, positions, token_type_ids))
        x = (self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
             + self.position_embeddings(positions + self.config.position_offset))
        x = self.embeddings_norm(x)
        seqs = PackedSequences.of(seq_starts)
        for layer in self.layers:
            x = layer(x, seqs)
        return x[:tokens]

    def classify(self, cls_hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler (dense + tanh of the [CLS] row) and the classifier: the logits of a cross-encoder."""
        return self.classifier(torch.tanh(self.pooler(cls_hidden)))

    def get_input_embeddings(self) -> Embedding:
        return self.word_embeddings

    def map_weight(self, name: str) -> WeightTarget | None:
        """Where a HF checkpoint weight goes (None: skip it). query/key/value fill rows of ``qkv``."""
        for prefix in ("bert.", "roberta.", "model."):
            name = name.removeprefix(prefix)
        if name.startswith(("cls.", "lm_head.")) or name == "embeddings.position_ids":
            return None  # masked-LM / next-sentence heads; a buffer of positions
        if name.startswith("pooler.") and self.pooler is None:
            return None  # BertModel's pooler, which an embedding's mean / CLS pooling never reads
        name = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # very old checkpoints
        hidden = self.config.hidden_size
        if name.startswith("encoder.layer."):
            _, _, n, rest = name.split(".", 3)
            for i, part in enumerate(_QKV):
                if rest.startswith(f"attention.self.{part}."):
                    return WeightTarget(f"layers.{n}.attention.qkv.{rest.rsplit('.', 1)[1]}", i * hidden, hidden)
            for theirs, ours in _LAYER_NAMES.items():
                if rest.startswith(theirs + "."):
                    return WeightTarget(f"layers.{n}.{ours}.{rest.rsplit('.', 1)[1]}")
            return WeightTarget(name)  # unknown: load_into names it
        if name.startswith("embeddings."):
            return WeightTarget(_EMBEDDING_NAMES.get(name.rsplit(".", 1)[0], name) + "." + name.rsplit(".", 1)[1])
        if name.startswith("pooler.dense."):
            return WeightTarget(name.replace("pooler.dense.", "pooler."))
        if name.startswith("classifier.out_proj."):  # (RoBERTa's classification head has a dense layer: refused)
            return WeightTarget(name.replace("classifier.out_proj.", "classifier."))
        return WeightTarget(name)


_LAYER_NAMES = {"attention.output.dense": "attention.dense", "attention.output.LayerNorm": "attention.norm",
                "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "output_norm"}
_EMBEDDING_NAMES = {"embeddings.word_embeddings": "word_embeddings",
                    "embeddings.position_embeddings": "position_embeddings",
                    "embeddings.token_type_embeddings": "token_type_embeddings",
                    "embeddings.LayerNorm": "embeddings_norm"}

ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "RobertaModel", "XLMRobertaModel",
                         "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification")


def from_hf(c: HFConfig, architecture: str) -> ModelConfig:
    hidden, heads = c.require("hidden_size"), c.require("num_attention_heads")
    c.expect("hidden_act", "gelu", why="the MLP runs exact (erf) GELU, as BERT's 'gelu'")
    c.expect("position_embedding_type", "absolute", why="learned absolute positions only")
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout", "gradient_checkpointing",
                "layer_norm_eps", "type_vocab_size", "pad_token_id"):
        c.get(key)  # read below, or training-only
    # a cross-encoder's activation, as sentence-transformers' CrossEncoder saves it: the sigmoid conveyor applies
    c.expect("sbert_ce_default_activation_function", "torch.nn.modules.activation.Sigmoid",
             why="a cross-encoder's score is the sigmoid of its logit")
    st = c.get("sentence_transformers") or {}
    if st.get("activation_fn") not in (None, "torch.nn.modules.activation.Sigmoid"):
        c.refuse("sentence_transformers", "a cross-encoder's score is the sigmoid of its logit")
    roberta = architecture.startswith(("Roberta", "XLMRoberta"))
    classifier = architecture.endswith("ForSequenceClassification")
    if classifier and roberta:
        c.refuse("architectures", "RoBERTa's classification head (dense, tanh, out_proj on <s>) is not built")
    labels = len(c.get("id2label") or {}) if classifier else 0
    if classifier and c.get("num_labels") is not None:
        labels = int(c.get("num_labels"))
    return ModelConfig(architecture=architecture, family="bert", hidden_size=hidden,
                       num_layers=c.require("num_hidden_layers"), num_heads=heads, num_kv_heads=heads,
                       head_dim=hidden // heads, intermediate_size=c.require("intermediate_size"),
                       vocab_size=c.require("vocab_size"),
                       # RoBERTa's positions start after the padding index (its table has pad + 1 more rows)
                       max_position_embeddings=c.require("max_position_embeddings") - (
                           c.get("pad_token_id", 1) + 1 if roberta else 0),
                       position_offset=c.get("pad_token_id", 1) + 1 if roberta else 0,
                       norm_eps=float(c.get("layer_norm_eps", 1e-12)), tie_word_embeddings=False,
                       activation="gelu", gated_mlp=False, causal=False,
                       type_vocab_size=int(c.get("type_vocab_size", 2)), num_labels=max(labels, 1) if classifier else 0,
                       bos_token_id=c.get("bos_token_id"), eos_token_ids=[])


def from_gguf(m: gguf_config.GGUFMeta) -> ModelConfig:
    f = m.f
    if m.get("attention.causal", True):
        m.refuse("attention.causal", "a BERT file with causal attention")
    if "cls.weight" in f.tensors or "cls.output.weight" in f.tensors:
        raise GGUFError(f"{f.path}: a BERT classifier (reranker) GGUF: llama.cpp's converter drops its pooler, "
                        "serve the Hugging Face directory instead")
    m.get("pooling_type")  # read by models.pooling_config
    hidden, heads = int(m.require("embedding_length")), int(m.require("attention.head_count"))
    types = f.tensors.get("token_types.weight")
    return ModelConfig(architecture="BertModel", family="bert", hidden_size=hidden,
                       num_layers=int(m.require("block_count")), num_heads=heads, num_kv_heads=heads,
                       head_dim=hidden // heads, intermediate_size=int(m.require("feed_forward_length")),
                       vocab_size=int(f.tensors["token_embd.weight"].shape[0]),
                       max_position_embeddings=int(m.require("context_length")),
                       norm_eps=float(m.require("attention.layer_norm_epsilon")), tie_word_embeddings=False,
                       activation="gelu", gated_mlp=False, causal=False,
                       type_vocab_size=int(types.shape[0]) if types is not None else 1, eos_token_ids=[])


FAMILY = ModelFamily(
    name="bert", hf_architectures=ENCODER_ARCHITECTURES, config_from_hf=from_hf, build=BertEncoder,
    gguf_architectures=("bert",), config_from_gguf=from_gguf,
    gguf_tensors={"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
                  "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
                  "ffn_up": "intermediate.dense", "ffn_down": "output.dense",
                  "layer_output_norm": "output.LayerNorm"},
    gguf_global_tensors={"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
                         "position_embd": "embeddings.position_embeddings",
                         "token_embd_norm": "embeddings.LayerNorm"},
    gguf_layer_prefix="encoder.layer",
    refused_architectures={"NomicBertModel": "nomic-bert's layers (rotary positions, SwiGLU, fused Wqkv) are not "
                                             "BERT's; only BERT-layout encoders are computed",
                           "ModernBertModel": "ModernBERT's layers (rotary positions, GeGLU, local attention) are "
                                              "not BERT's"})
