"""``conveyor bench ...`` subcommands. Each benchmark module adds its own parser here."""

from __future__ import annotations


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="benchmarks: offline throughput, policy comparison, workloads, HTTP")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from conveyor.bench.offline import add_offline_parser

    add_offline_parser(bench_sub)
    from conveyor.bench.workload_gen import add_workload_parser

    add_workload_parser(bench_sub)
    from conveyor.bench.compare import add_compare_parser

    add_compare_parser(bench_sub)
    from conveyor.bench.serve_client import add_serve_client_parser

    add_serve_client_parser(bench_sub)
    from conveyor.bench.ppl import add_ppl_parser

    add_ppl_parser(bench_sub)
    from conveyor.bench.step import add_step_parser

    add_step_parser(bench_sub)
    from conveyor.bench.kv_eviction import add_kv_eviction_parser

    add_kv_eviction_parser(bench_sub)
    from conveyor.bench.mixed_cli import add_mixed_parser

    add_mixed_parser(bench_sub)


def add_sim_parser(sub) -> None:
    sim = sub.add_parser("sim", help="the simulator: calibrate it on this machine (run it: bench compare --simulate)")
    sim_sub = sim.add_subparsers(dest="sim_command", required=True)
    from conveyor.bench.calibrate import add_calibrate_parser

    add_calibrate_parser(sim_sub)
    from conveyor.bench.prediction import add_errors_parser

    add_errors_parser(sim_sub)
