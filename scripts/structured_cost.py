"""What structured outputs cost the batch: the long-tail trace all at t=0 through one offline engine, with half of
its requests constrained by a JSON schema, against the same trace unconstrained, alternated in one process.

    python scripts/structured_cost.py [--model M] [--rounds 2] [--dtype float32]

Constrained replies end when their JSON does, so the two runs produce different token counts: the measures are
output tokens per second of the whole run and the median time per output token (TPOT) of the unconstrained half,
which shares every step with the constrained half. Also checks that every constrained reply that finished
validates, and that the unconstrained replies are token-identical in both runs (greedy). Prints the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jsonschema

from conveyor.bench.workload import load_workload
from conveyor.core.sampling_params import SamplingParams, StructuredOutputsParams
from conveyor.engine.llm import LLM

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 60},
    "summary": {"type": "string", "maxLength": 400},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 8},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "sections": {"type": "array", "maxItems": 6, "items": {"type": "object", "properties": {
        "heading": {"type": "string", "maxLength": 40}, "body": {"type": "string", "maxLength": 300}},
        "required": ["heading", "body"], "additionalProperties": False}}},
    "required": ["title", "summary", "tags", "rating", "sections"], "additionalProperties": False}


def run(llm: LLM, workload, constrained: bool) -> dict:
    params = []
    for i, r in enumerate(workload.requests):
        p = r.sampling_params()
        p.temperature = 0.0
        if constrained and i % 2 == 0:
            p = SamplingParams(max_tokens=p.max_tokens, temperature=0.0,
                               structured_outputs=StructuredOutputsParams(json=SCHEMA))
        params.append(p)
    start = time.perf_counter()
    outs = llm.generate([r.engine_prompt() for r in workload.requests], params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    tpots = []
    for i, o in enumerate(outs):
        times = o.outputs[0].token_times
        if i % 2 == 1 and len(times) > 1:
            tpots.append((times[-1] - times[0]) / (len(times) - 1))
    invalid = 0
    for i, o in enumerate(outs):
        if constrained and i % 2 == 0 and o.outputs[0].finish_reason == "stop":
            try:
                jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
            except (ValueError, jsonschema.ValidationError):
                invalid += 1
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "tpot_p50_ms": 1e3 * statistics.median(tpots),
            "invalid": invalid, "plain_ids": [o.outputs[0].token_ids for i, o in enumerate(outs) if i % 2 == 1]}


def big_schema(salt: int) -> dict:
    """A schema no cache holds (``salt`` makes it new): 40 properties with patterns, enums and bounds."""
    props = {}
    for i in range(40):
        kind = i % 4
        props[f"f{salt}_{i}"] = ({"type": "string", "pattern": f"^[a-z]{{{1 + i % 5}}}-[0-9]{{2}}$"} if kind == 0 else
                                 {"enum": [f"v{salt}_{i}_{k}" for k in range(6)]} if kind == 1 else
                                 {"type": "integer", "minimum": -i, "maximum": 1000 + i} if kind == 2 else
                                 {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3})
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def new_schema_stall(llm: LLM, steps_before: int = 30, steps_after: int = 10, arrive: bool = True
                     ) -> tuple[float, float]:
    """32 plain requests decoding; a request with a new large schema arrives between two steps (``arrive``;
    False: the control, nothing arrives). Returns (median step before it, longest of the steps_after steps after
    it), in ms: the compile runs off the step loop."""
    engine = llm.engine
    for i in range(32):
        engine.add_request(f"plain-{i}", {"prompt_token_ids": [100 + i] * 16},
                           SamplingParams(temperature=0.0, max_tokens=steps_before + steps_after + 20, ignore_eos=True))
    durations = []
    for k in range(steps_before + steps_after):
        if k == steps_before and arrive:
            engine.add_request("schema", {"prompt_token_ids": [7] * 16}, SamplingParams(
                temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(json=big_schema(k))))
        start = time.perf_counter()
        engine.step()
        durations.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    before = statistics.median(durations[:steps_before])
    return 1e3 * before, 1e3 * max(durations[steps_before:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workload", default="longtail_v1")
    ap.add_argument("--rounds", type=int, default=2)
    ns = ap.parse_args()
    workload = load_workload(ns.workload)
    llm = LLM(model=ns.model, dtype=ns.dtype, max_model_len=2048)
    run(llm, workload, True)  # warm-up: kernels, the grammar's first compile
    rows = {False: [], True: []}
    for k in range(ns.rounds):
        for constrained in ((False, True) if k % 2 == 0 else (True, False)):
            rows[constrained].append(run(llm, workload, constrained))
    for constrained, rs in rows.items():
        for r in rs:
            print(f"{'half constrained' if constrained else 'unconstrained   '}: {r['wall_s']:.1f} s, {r['tokens']} "
                  f"tokens, {r['tok_s']:.1f} tok/s, TPOT p50 (unconstrained half) {r['tpot_p50_ms']:.1f} ms, "
                  f"{r['invalid']} invalid")
    same = all(a["plain_ids"] == b["plain_ids"] for a in rows[False] for b in rows[True])
    tok = statistics.median(r["tok_s"] for r in rows[True]) / statistics.median(r["tok_s"] for r in rows[False])
    tpot = statistics.median(r["tpot_p50_ms"] for r in rows[True]) / statistics.median(
        r["tpot_p50_ms"] for r in rows[False])
    print(f"ratio half-constrained / unconstrained: throughput {tok:.3f}, TPOT p50 {tpot:.3f}; unconstrained "
          f"greedy outputs identical across runs: {same}")
    llm.engine.structured.prepare()  # as a server does at start-up
    for k in range(3):
        for arrive in (True, False):
            before, after = new_schema_stall(llm, arrive=arrive)
            print(f"{'a new 40-property schema arrives' if arrive else 'control, nothing arrives    '}: median "
                  f"step before {before:.1f} ms, longest of the 10 steps after {after:.1f} ms")


if __name__ == "__main__":
    main()
