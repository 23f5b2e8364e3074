"""sync=auto's model against bench/tta's recorded results: for each of bench/tta's clusters, the measurements its
probe would take there, every candidate's predicted time to the target (relative to allreduce's) beside the time
the runs took, and the choice. No run: it reads sync=auto's steps ratios (``bench/results/tta_ratios.jsonl``) and
bench/tta's table (``bench/results/tta.jsonl``: the times, and the pace) and prints a markdown table.

    python -m bench.auto_model [--data bench/results/tta_ratios.jsonl] [--runs bench/results/tta.jsonl]
    python -m bench.auto_model --links 10000,1000,100,10   # the choice at each link rate, every node alike

The clusters are bench/tta's (docs/benchmarks/tta.md): 4 nodes whose pace (a step without its exchange: what the
probe measures) is the step of the data's ``sync=none`` cell at 100 Mbit (4 workers on 2 cores: 0.043 s in
bench/results/tta.jsonl), links of 100 Mbit or 1 Gbit through TCP/IP and tbf (1.07x slower than their rate), and the
uneven one: 1 Gbit with the last node at 100 Mbit and rank 1 computing 3x slower.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from algorithms.auto import DATA
from algorithms.auto.model import Measured, decide, read_step_ratios
from bench.common import RESULTS, config

NODES, BATCH = 4, 32  # bench/tta's cluster and a node's batch
WIRE = 1.07  # TCP/IP and tbf's overhead over the link's rate
PROBE = 1 << 18
LATENCY_S = 0.0005
MBIT = 1e6 / 8 / WIRE  # bytes a second of a megabit link, as the runs saw it
RUNS = RESULTS / "tta.jsonl"  # bench/tta's table: every option once at each cluster, sync=none's pace among them
LINKS = (100_000.0, 10_000.0, 1000.0, 500.0, 200.0, 100.0, 50.0, 20.0, 10.0)  # --links' default sweep, megabit/s


def pace(records: list[dict]) -> float:
    """Seconds of a step with nothing exchanged: the ``sync=none`` cell's at 100 Mbit."""
    none = next(r for r in records if r["scenario"] == "fleet" and r["algorithm"] == "none")
    return NODES * BATCH / none["samples_per_s"]


def cluster(shapes: tuple[tuple[int, ...], ...], compute: list[float], mbit: list[float]) -> Measured:
    """What the probe would measure on nodes computing ``compute`` seconds a step behind links of ``mbit``."""
    links = tuple(LATENCY_S + PROBE / (m * MBIT) for m in mbit)
    return Measured(shapes, tuple(compute), links, PROBE, LATENCY_S)


def clusters(shapes: tuple[tuple[int, ...], ...], pace_s: float) -> dict[str, Measured]:
    return {
        "fleet": cluster(shapes, [pace_s] * NODES, [100] * NODES),
        "1gbit": cluster(shapes, [pace_s] * NODES, [1000] * NODES),
        "uneven": cluster(shapes, [pace_s, 3 * pace_s, pace_s, pace_s], [1000] * 3 + [100]),
    }


def inputs(data: Path, runs: Path) -> tuple[dict, tuple[tuple[int, ...], ...], dict[str, float], list[dict]]:
    """sync=auto's candidates, bench/tta's model's tensor shapes, the steps ratios of ``data``, the records of
    ``runs``."""
    import timm

    candidates = config(["sync=auto"])["sync"]["candidates"]
    shapes = tuple(tuple(p.shape) for p in timm.create_model("test_resnet", num_classes=10).parameters())
    records = [json.loads(line) for line in runs.read_text().splitlines() if line.strip()]
    return candidates, shapes, read_step_ratios(data), records


def table(data: Path, runs: Path = RUNS) -> str:
    candidates, shapes, ratios, records = inputs(data, runs)
    lines = [
        "| scenario | candidate | predicted s/step | steps ratio | predicted time vs allreduce "
        "| recorded time vs allreduce |",
        "|---|---|---|---|---|---|",
    ]
    chosen = []
    for scenario, measured in clusters(shapes, pace(records)).items():
        choice = decide(candidates, ratios, measured, current="allreduce")
        seconds = {r["algorithm"]: r["seconds"] for r in records if r["scenario"] == scenario and r["reached"]}
        allreduce = choice.predicted("allreduce").score
        best = min(seconds, key=seconds.get)
        chosen.append(f"- {scenario}: chooses **{choice.key}**; fastest recorded: {best}")
        for p in sorted(choice.predictions, key=lambda p: p.score):
            recorded = seconds.get(p.key)
            shown = f"{recorded / seconds['allreduce']:.2f}x" if recorded else "–"
            mark = " (chosen)" if p.key == choice.key else ""
            lines.append(
                f"| {scenario} | {p.key}{mark} | {p.step_s:.3f} | {p.steps_ratio:.2f} | {p.score / allreduce:.2f}x "
                f"| {shown} |"
            )
    return "\n".join(lines + [""] + chosen)


def by_link(
    data: Path, runs: Path = RUNS, mbits: tuple[float, ...] = LINKS
) -> list[tuple[float, list[tuple[str, float]]]]:
    """On bench/tta's 4 even nodes with every link at each of ``mbits`` megabit/s: the candidates, the chosen first,
    each with its predicted time to the target over the chosen one's."""
    candidates, shapes, ratios, records = inputs(data, runs)
    pace_s = pace(records)
    rows = []
    for mbit in mbits:
        choice = decide(candidates, ratios, cluster(shapes, [pace_s] * NODES, [mbit] * NODES))
        best = choice.predicted(choice.key).score
        others = sorted((p for p in choice.predictions if p.key != choice.key), key=lambda p: p.score)
        rows.append((mbit, [(choice.key, 1.0)] + [(p.key, p.score / best) for p in others]))
    return rows


def links_table(data: Path, runs: Path = RUNS, mbits: tuple[float, ...] = LINKS) -> str:
    """:func:`by_link` as a markdown table: the chosen option and the next three, by predicted time over its."""
    lines = ["| every link | chosen | then (predicted time over the chosen's) |", "|---|---|---|"]
    for mbit, ranked in by_link(data, runs, mbits):
        rate = f"{mbit / 1000:g} Gbit" if mbit >= 1000 else f"{mbit:g} Mbit"
        then = ", ".join(f"{key} {ratio:.2f}x" for key, ratio in ranked[1:4])
        lines.append(f"| {rate} | {ranked[0][0]} | {then} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DATA, help="the steps ratios' bench/tta results")
    parser.add_argument("--runs", type=Path, default=RUNS, help="the bench/tta results the times and pace are from")
    parser.add_argument(
        "--links",
        default=None,
        metavar="MBIT,...",
        help="instead: the choice on 4 even nodes at each of these link rates (megabit/s; '' for the default sweep)",
    )
    args = parser.parse_args()
    if args.links is None:
        print(table(args.data, args.runs))
    else:
        mbits = tuple(float(m) for m in args.links.split(",") if m.strip()) or LINKS
        print(links_table(args.data, args.runs, mbits))


if __name__ == "__main__":
    main()
