"""The ``conveyor`` command line: ``generate``, ``chat``, ``serve``, ``bench ...``.

Each subcommand lives with its layer (``bench/cli.py``; ``serve.py``, which sits above ``server/`` and
``distributed/``); this file only wires them up, and imports a layer only when its subcommand runs, so
``conveyor --help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts given on the command line or stdin "
                       "(raw text, no chat template: see `conveyor chat`)")
    p.add_argument("prompts", nargs="*", help="prompts (default: one per line from stdin)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--n", type=int, default=1)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[])
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    from conveyor.engine.args import EngineArgs

    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(ns: argparse.Namespace) -> int:
    import json

    from conveyor.core.sampling_params import SamplingParams
    from conveyor.engine.args import EngineArgs
    from conveyor.engine.llm import LLM
    from conveyor.models.embedded import warn_if_random

    prompts = ns.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        prompts = ["The conveyor belt carries"]
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            n=ns.n, seed=ns.sampling_seed, stop=ns.stop, ignore_eos=ns.ignore_eos)
    args = EngineArgs.from_cli_args(ns)
    llm = LLM(**vars(args))
    info = llm.engine.model_info
    warn_if_random(info.name)
    print(f"[conveyor] dtype {info.dtype} ({info.dtype_reason})", file=sys.stderr)
    for out in llm.generate(prompts, params, use_tqdm=False):
        if ns.json:
            print(json.dumps({"prompt": out.prompt, "completions": [
                {"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason} for c in out.outputs]}))
        else:
            for c in out.outputs:
                print(f"{out.prompt!r} -> {c.text!r} [{c.finish_reason}, {len(c.token_ids)} tokens]")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="conveyor", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    from conveyor.chat_cli import add_chat_parser

    add_chat_parser(sub)
    from conveyor.bench.cli import add_bench_parser

    add_bench_parser(sub)
    from conveyor.bench.cli import add_sim_parser

    add_sim_parser(sub)
    from conveyor.serve import add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns) or 0
    except (OSError, ValueError) as exc:  # a model, file, directory or flag that cannot be used: say why, briefly
        print(f"conveyor {ns.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
