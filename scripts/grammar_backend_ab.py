"""xgrammar vs llguidance on SmolLM2's tokenizer: tokenizer setup, per-schema compile, per-token mask fill.

    pip install xgrammar  # not a dependency of conveyor (it pulls triton); then
    python scripts/grammar_backend_ab.py
"""
import json, time, statistics
from conveyor.tokenizer import load_tokenizer
from transformers import PreTrainedTokenizerFast

tok = load_tokenizer(None)
rust = tok._tok
hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token=tok.eos_token, bos_token=tok.bos_token)
V = tok.vocab_size
SCHEMAS = {
 "person": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"}, "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]},
 "nested": {"type": "object", "properties": {"order": {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}, "price": {"type": "number"}}, "required": ["sku", "qty"]}}},
    "required": ["id", "items"]}}, "required": ["order"]},
}
SAMPLES = {"person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com", "tags": ["math", "poet"], "role": "admin"},
           "nested": {"order": {"id": "ABC-1234", "items": [{"sku": "x1", "qty": 2, "price": 3.5}, {"sku": "y2", "qty": 1}]}}}

def tokens_of(name):
    return rust.encode(json.dumps(SAMPLES[name]), add_special_tokens=False).ids

# llguidance
import llguidance, llguidance.torch as llt
t = time.perf_counter(); lltok = llguidance.LLTokenizer(rust.to_str(), eos_token=tok.eos_token_id); t_ll_setup = time.perf_counter() - t
# xgrammar
import xgrammar as xgr
t = time.perf_counter(); info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=V); comp = xgr.GrammarCompiler(info, max_threads=1); t_xg_setup = time.perf_counter() - t
print(f"tokenizer setup: llguidance {t_ll_setup*1e3:.0f} ms, xgrammar {t_xg_setup*1e3:.0f} ms (vocab {V})")
for name, schema in SCHEMAS.items():
    ids = tokens_of(name)
    # llguidance
    t = time.perf_counter(); g = llguidance.LLMatcher.grammar_from_json_schema(schema); m = llguidance.LLMatcher(lltok, g); c_ll = time.perf_counter() - t
    assert not m.is_error(), m.get_error()
    mask = llt.allocate_token_bitmask(1, V); fills = []
    for tid in ids:
        t = time.perf_counter(); llt.fill_next_token_bitmask(m, mask, 0); fills.append(time.perf_counter() - t)
        assert (int(mask[0, tid // 32]) >> (tid % 32)) & 1, "llguidance refuses a valid token"
        assert m.consume_token(tid)
    llt.fill_next_token_bitmask(m, mask, 0); eos_ok = (int(mask[0, tok.eos_token_id // 32]) >> (tok.eos_token_id % 32)) & 1
    ll_fill = statistics.median(fills)
    # xgrammar
    t = time.perf_counter(); cg = comp.compile_json_schema(json.dumps(schema)); mx = xgr.GrammarMatcher(cg); c_xg = time.perf_counter() - t
    bm = xgr.allocate_token_bitmask(1, info.vocab_size); xf = []
    for tid in ids:
        t = time.perf_counter(); mx.fill_next_token_bitmask(bm, 0); xf.append(time.perf_counter() - t)
        assert (int(bm[0, tid // 32]) >> (tid % 32)) & 1, "xgrammar refuses a valid token"
        assert mx.accept_token(tid)
    t = time.perf_counter(); cg2 = comp.compile_json_schema(json.dumps(schema)); c_xg_cached = time.perf_counter() - t
    print(f"{name}: {len(ids)} tokens | compile+matcher: llguidance {c_ll*1e3:.1f} ms, xgrammar {c_xg*1e3:.1f} ms "
          f"(cached {c_xg_cached*1e3:.2f}) | mask fill p50: llguidance {ll_fill*1e6:.0f} us (max {max(fills)*1e6:.0f}), "
          f"xgrammar {statistics.median(xf)*1e6:.0f} us (max {max(xf)*1e6:.0f}) | eos allowed at end (ll): {bool(eos_ok)}")
