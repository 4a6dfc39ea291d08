"""Workload traces: a JSON trace format (load, save, and the per-request spec), and the traces shipped with the
package (``bench/traces/``), which every benchmark takes by name: ``--workload longtail_v1``.

``longtail_v1`` (100 requests: 80 chat turns, 20 RAG prompts, token ids of the bench model's 32,000 vocabulary,
greedy with ``ignore_eos``, Poisson arrivals at 4 req/s) is the trace the peers' numbers were measured on.

A trace is a list of requests, each with a prompt (token ids or text), sampling fields named as in
``SamplingParams`` and an arrival time in seconds since the start. Generators (long-tail, uniform,
shared-prefix traffic) live in ``workload_gen.py`` and produce the same objects.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from importlib import resources
from pathlib import Path

from conveyor.core.sampling_params import SamplingParams

_PARAM_NAMES = {f.name for f in fields(SamplingParams)}


@dataclass
class WorkloadRequest:
    """One request of a trace."""

    id: int | str
    arrival_s: float = 0.0
    prompt_token_ids: list[int] | None = None
    prompt: str | None = None
    max_tokens: int = 16
    kind: str = ""
    params: dict = field(default_factory=dict)  # other SamplingParams fields (temperature, ignore_eos, ...)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(**{"max_tokens": self.max_tokens, **self.params})

    def engine_prompt(self) -> dict | str:
        if self.prompt_token_ids is not None:
            return {"prompt_token_ids": self.prompt_token_ids}
        assert self.prompt is not None
        return self.prompt


@dataclass
class Workload:
    """A named, seeded list of requests with arrival times."""

    name: str
    requests: list[WorkloadRequest]
    seed: int | None = None
    arrival_rate_req_s: float | None = None
    notes: str = ""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    def all_at_once(self) -> Workload:
        """The same requests, every arrival at t=0 (offline runs)."""
        reqs = [WorkloadRequest(**{**asdict(r), "arrival_s": 0.0}) for r in self.requests]
        return Workload(self.name, reqs, self.seed, None, self.notes)

    def to_json(self) -> dict:
        out = []
        prev = 0.0
        for r in self.requests:
            d = {"id": r.id, "kind": r.kind, "prompt_len": r.prompt_len, "output_len": r.max_tokens,
                 "max_tokens": r.max_tokens, "gap_s": round(r.arrival_s - prev, 6), "arrival_s": round(r.arrival_s, 6),
                 **r.params}
            if r.prompt_token_ids is not None:
                d["prompt_token_ids"] = r.prompt_token_ids
            if r.prompt is not None:
                d["prompt"] = r.prompt
            prev = r.arrival_s
            out.append(d)
        return {
            "name": self.name, "seed": self.seed, "num_requests": len(out), "arrival_rate_req_s": self.arrival_rate_req_s,
            "notes": self.notes,
            "totals": {"prompt_tokens": self.num_prompt_tokens, "output_tokens": self.num_output_tokens},
            "requests": out,
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json()))


def packaged_workloads() -> list[str]:
    """Names of the traces shipped in ``conveyor/bench/traces/``."""
    return sorted(p.name.removesuffix(".json") for p in resources.files("conveyor.bench").joinpath("traces").iterdir()
                  if p.name.endswith(".json"))


def workload_path(spec: str | Path) -> Path:
    """A trace file path, or a packaged trace's name (``longtail_v1``; ``workload_longtail_v1`` also works)."""
    path = Path(spec)
    if path.is_file():
        return path
    name = str(spec).removeprefix("workload_").removesuffix(".json")
    if name in packaged_workloads():
        return Path(str(resources.files("conveyor.bench").joinpath("traces", f"{name}.json")))
    raise FileNotFoundError(f"workload {str(spec)!r} is neither a file nor a packaged trace "
                            f"({', '.join(packaged_workloads())})")


def load_workload(spec: str | Path) -> Workload:
    """Read a trace (a path or a packaged trace's name): a JSON object as ``Workload.to_json`` writes, or JSONL
    with one request a line."""
    path = workload_path(spec)
    text = path.read_text()
    if path.suffix == ".jsonl":
        data = {"name": path.stem, "requests": [json.loads(line) for line in text.splitlines() if line.strip()]}
    else:
        data = json.loads(text)
    requests = []
    t = 0.0
    for i, raw in enumerate(data["requests"]):
        t = raw["arrival_s"] if "arrival_s" in raw else t + raw.get("gap_s", 0.0)
        if "prompt_token_ids" not in raw and "prompt" not in raw:
            raise ValueError(f"request {i} of {path} has neither prompt_token_ids nor prompt")
        max_tokens = raw.get("max_tokens", raw.get("output_len", 16))
        params = {k: v for k, v in raw.items() if k in _PARAM_NAMES and k != "max_tokens"}
        requests.append(WorkloadRequest(raw.get("id", i), t, raw.get("prompt_token_ids"), raw.get("prompt"),
                                        max_tokens, raw.get("kind", ""), params))
    return Workload(data.get("name", path.stem), requests, data.get("seed"), data.get("arrival_rate_req_s"),
                    data.get("notes", ""))


def time_scale_for(workload: Workload, rate: float | None, time_scale: float) -> float:
    """Arrival-time multiplier: ``time_scale``, or what turns the trace's rate into ``rate`` req/s."""
    if rate is None:
        return time_scale
    native = workload.arrival_rate_req_s
    if not native:
        last = max(r.arrival_s for r in workload.requests)
        native = len(workload.requests) / last if last > 0 else None
    if not native:
        raise ValueError("--request-rate needs a workload with arrival times (not --offline)")
    return native / rate
