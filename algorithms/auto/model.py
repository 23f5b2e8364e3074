"""The model ``sync=auto`` decides by, as docs/algorithms.md ("Which sync should I use?") writes it down:

    time to the target (option)  =  steps to it, relative to allreduce's (data)  x  seconds per step (predicted)

**Seconds per step** come from what the probe measured on this cluster (:class:`Measured`): the slowest replica's
pace, a step without its exchange (every option waits for it, at every step or at every k-th), and the seconds of
what the option sends per step (:func:`traffic`, from the model's tensors and the option's settings) on the
slowest link that carries it, added to the pace, or the larger of the two where the option overlaps its exchange
with the next steps' compute (streaming DiLoCo's delay, gossip's overlap). A ring allreduce of S bytes over N
replicas costs ``2 (N - 1)`` messages and ``2 (N - 1) / N x S`` bytes through each link; an all-gather of S bytes
each, ``N - 1`` messages and ``(N - 1) x S``; a push to one peer, one message and S.

**Steps relative to allreduce** are data, read from a bench/tta result file (:func:`step_ratios`): each option's
steps to the target over allreduce's in the same scenario, the median over the scenarios in which both reached it.
An option the data never saw reach the target is no candidate.

**sync=decoupled** is priced as streaming DiLoCo (its exchange, plus a header per learner and round) at the median
replica's pace where it catches up (a learner k times slower computes one step in k), its steps ratio the data's
over the share of steps computed (:func:`samples_share`).

**Relaxed sync on top** (a candidate whose section wraps another in ``algorithms.relaxed.RelaxedSync``) is
considered only where it would evict someone: the replicas slower than its threshold x the median (by compute, or
by link under ``measure=link``) leave the pace and the links, and its steps ratio is the data's for that
composition (measured on the uneven cluster, where it evicts).

Left out, and so not candidates by default: adaptive local SGD, whose traffic is set by the loss as it falls, not
by its settings. PowerSGD's factorisation and DGC's selection cost compute the model does not count; DGC's traffic
is that after its warm-up.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from algorithms.compress import TopK, fp4_bytes
from algorithms.quorum import CATCH_UP_TOLERANCE

FLOAT_BYTES = 4  # what gradients and parameters travel as (fp32)
INDEX_BYTES = 4  # DGC's int32 indices
INT8_BYTES = 1
HEADER_BYTES = 5 * 8  # sync=decoupled: each learner's header in a round (5 float64 values)


@dataclass(frozen=True)
class Measured:
    """What the probe measured: the shapes of the tensors the exchanges carry, and per replica (a node under
    ``sync.scope=node``, else a process) its pace (``compute_s``: the seconds of a step without its exchange: data,
    forward, backward, optimizer step) and its fastest exchange of ``probe_bytes`` each way with a peer
    (``Communicator.probe_links``), and the seconds of an exchange of a few bytes (the latency of one message)."""

    shapes: tuple[tuple[int, ...], ...]
    compute_s: tuple[float, ...]
    link_s: tuple[float, ...]
    probe_bytes: int
    latency_s: float

    @property
    def params(self) -> int:
        return sum(math.prod(s) for s in self.shapes)

    @property
    def replicas(self) -> int:
        return len(self.compute_s)

    def bandwidth(self, replica: int) -> float:
        """Bytes a second through ``replica``'s link."""
        return self.probe_bytes / max(self.link_s[replica] - self.latency_s, 1e-9)

    def as_dict(self) -> dict[str, Any]:
        """What a ``sync_chosen`` event records of it."""

        def finite(values: Sequence[float]) -> list[float | None]:  # (a replica alone has no link: None)
            return [v if math.isfinite(v) else None for v in values]

        return {
            "params": self.params,
            "compute_s": list(self.compute_s),
            "link_s": finite(self.link_s),
            "probe_bytes": self.probe_bytes,
            "latency_s": self.latency_s if math.isfinite(self.latency_s) else None,
            "bandwidth_mb_s": [round(self.bandwidth(i) / 1e6, 3) for i in range(self.replicas)],
        }


@dataclass(frozen=True)
class Traffic:
    """What an option sends per step, on average, by the kind of collective that carries it."""

    ring_bytes: float = 0.0  # allreduced by each replica per step (a ring)
    rings: float = 0.0  # allreduces per step
    gather_bytes: float = 0.0  # each replica's part of an all-gather per step
    gathers: float = 0.0
    push_bytes: float = 0.0  # sent to one peer per step
    pushes: float = 0.0
    overlapped: bool = False  # the exchange runs while the next steps compute

    def seconds(self, replicas: int, bandwidth: float, latency_s: float) -> float:
        """Seconds per step of this traffic among ``replicas`` on links of ``bandwidth`` bytes/s."""
        n = replicas
        if n < 2:
            return 0.0
        ring = self.rings * 2 * (n - 1) * latency_s + 2 * (n - 1) / n * self.ring_bytes / bandwidth
        gather = self.gathers * (n - 1) * latency_s + (n - 1) * self.gather_bytes / bandwidth
        push = self.pushes * latency_s + self.push_bytes / bandwidth
        return ring + gather + push

    def bytes_sent(self, replicas: int) -> float:
        """Bytes each replica sends per step, as the communicator counts them."""
        n = replicas
        if n < 2:
            return 0.0
        return 2 * (n - 1) / n * self.ring_bytes + (n - 1) * self.gather_bytes + self.push_bytes


def _option(section: Mapping[str, Any]) -> str:
    return str(section["_target_"]).rsplit(".", 1)[-1]


def traffic(section: Mapping[str, Any], shapes: Sequence[Sequence[int]]) -> Traffic:
    """What the option ``section`` configures (a ``sync`` section) sends per step for a model whose tensors have
    ``shapes``, from its settings. Raises ``ValueError`` for an option whose traffic its settings do not settle."""
    option = _option(section)
    numels = [math.prod(s) for s in shapes]
    dense = FLOAT_BYTES * sum(numels)
    if option == "RelaxedSync":
        return traffic(section["inner"], shapes)  # (its link probe: once a check, not per step)
    if option == "AllReduce":
        return Traffic(ring_bytes=dense, rings=1)
    if option == "LocalSGD":
        k = int(section["k_steps"])
        return Traffic(ring_bytes=dense / k, rings=1 / k)
    if option == "DecoupledDiLoCo":  # (streaming DiLoCo's exchange, with every learner's header each round)
        base = traffic({**section, "_target_": "algorithms.diloco.DiLoCo"}, shapes)
        per_round = int(section.get("fragments", 1)) / int(section["inner_steps"])
        header = HEADER_BYTES * per_round
        return dataclasses.replace(base, gather_bytes=base.gather_bytes + header, gathers=base.gathers + per_round)
    if option == "DiLoCo":
        h, delay, fragments = (
            int(section["inner_steps"]),
            int(section.get("delay", 0)),
            int(section.get("fragments", 1)),
        )
        quantize, params = str(section.get("quantize", "none")), sum(numels)
        block = int(section.get("quant_block", 1024))
        if quantize in ("int8", "fp4", "sparse"):  # (gathered: codes do not sum)
            if quantize == "int8":  # (a fp32 minimum and scale per block)
                packed = INT8_BYTES * params + 2 * FLOAT_BYTES * math.ceil(params / block)
            elif quantize == "fp4":
                packed = fp4_bytes(params, block)
            else:  # (the fragments as segment_ranges cuts them)
                bounds = [round(i * params / fragments) for i in range(fragments + 1)]
                sizes = [b - a for a, b in zip(bounds, bounds[1:])]
                chunk, density = int(section.get("chunk", 4096)), float(section.get("density", 0.02))
                packed = sum(TopK.of(n, chunk, density).bytes for n in sizes)
            return Traffic(gather_bytes=packed / h, gathers=fragments / h, overlapped=delay > 0)
        width = 2 if quantize == "fp16" else FLOAT_BYTES
        return Traffic(ring_bytes=width * params / h, rings=fragments / h, overlapped=delay > 0)
    if option in ("SGP", "Crossover"):
        period = int(section.get("period", 1))
        return Traffic(push_bytes=dense / period, pushes=1 / period, overlapped=bool(section.get("overlap", False)))
    if option == "DGC":
        density = 1.0 - float(list(section["sparsity"])[-1])
        big = [n for n in numels if n >= int(section.get("min_compress_numel", 16384))]
        value = 2 if section.get("fp16_values", False) else FLOAT_BYTES
        kept = sum(max(1, math.ceil(density * n)) for n in big)
        return Traffic(
            ring_bytes=FLOAT_BYTES * (sum(numels) - sum(big)),
            rings=1,
            gather_bytes=(value + INDEX_BYTES) * kept,
            gathers=1,
        )
    if option == "PowerSGD":
        r, rate = int(section["matrix_approximation_rank"]), float(section.get("min_compression_rate", 2.0))
        sent = 0
        for s, n in zip(shapes, numels):
            rows = s[0] if s else 1
            cols = n // max(rows, 1)
            factored = len(s) > 1 and (rows + cols) * r * rate < rows * cols
            sent += (rows + cols) * r if factored else n
        return Traffic(ring_bytes=FLOAT_BYTES * sent, rings=2)  # (P, then Q: two allreduces a step)
    raise ValueError(f"the traffic of sync option {option} is not settled by its settings")


def _evicts(section: Mapping[str, Any]) -> tuple[float, str] | None:
    """Relaxed sync's threshold and measure, where ``section`` is relaxed sync over an option; else None."""
    if _option(section) != "RelaxedSync":
        return None
    return float(section.get("relaxed_sync_threshold", 3.0)), str(section.get("measure", "compute"))


def kept(section: Mapping[str, Any], measured: Measured) -> list[int]:
    """The replicas that would train on under ``section``: all of them, but under relaxed sync those it evicts."""
    everyone = list(range(measured.replicas))
    rule = _evicts(section)
    if rule is None or measured.replicas < 2:
        return everyone
    threshold, measure = rule
    times = measured.link_s if measure == "link" else measured.compute_s
    if measure == "link" and measured.replicas < 3:
        return everyone  # (a slow link needs three to be told)
    reference = statistics.median(times) if len(times) > 2 else min(times)
    return [i for i in everyone if times[i] <= threshold * reference]


def _catches_up(section: Mapping[str, Any]) -> bool:
    return _option(section) == "DecoupledDiLoCo" and bool(section.get("catch_up", True))


def pace_of(section: Mapping[str, Any], measured: Measured, replicas: list[int]) -> float:
    """Seconds per step of the replicas' compute under ``section``: the slowest's, which every option waits for,
    but under sync=decoupled with ``catch_up`` the median's (a learner slower than that skips steps to keep it)."""
    paces = [measured.compute_s[i] for i in replicas]
    return statistics.median(paces) if _catches_up(section) else max(paces)


def samples_share(section: Mapping[str, Any], measured: Measured) -> float:
    """The share of the replicas' steps that are computed: 1, but under sync=decoupled with ``catch_up`` a learner
    k times slower than the median computes one step in k (one within the tolerance, every step). Its steps to the
    target are its data's (measured where every learner computes every step) over this share."""
    replicas = kept(section, measured)
    if not _catches_up(section):
        return 1.0
    pace = pace_of(section, measured, replicas)
    slowest = (1 + CATCH_UP_TOLERANCE) * pace
    paces = [measured.compute_s[i] for i in replicas]
    return sum(1.0 if p <= slowest else pace / p for p in paces) / len(replicas)


def step_seconds(section: Mapping[str, Any], measured: Measured) -> float:
    """Predicted seconds per step of the option ``section`` on the measured cluster."""
    replicas = kept(section, measured)
    pace = pace_of(section, measured, replicas)
    bandwidth = min(measured.bandwidth(i) for i in replicas)
    sent = traffic(section, measured.shapes)
    comm = sent.seconds(len(replicas), bandwidth, measured.latency_s)
    return max(pace, comm) if sent.overlapped else pace + comm


# ---- the data: steps to the target, relative to allreduce --------------------------------------------------------
def step_ratios(records: Iterable[Mapping[str, Any]], baseline: str = "allreduce") -> dict[str, float]:
    """From bench/tta's records (one per run: ``scenario``, ``algorithm``, ``reached``, ``steps``): each option's
    steps to the target over ``baseline``'s in the same scenario of the same bench run (``run``, where recorded: a
    seed's steps differ between CPUs, so an option is only ever set against the baseline that ran beside it), the
    median over the scenarios where both reached it (the baseline's own: 1.0). Options that never reached it where
    the baseline did are left out. Repeated runs of an option in a scenario (``--repeats``) count as their median
    steps."""
    runs: dict[tuple[str, str], dict[str, list[int]]] = {}
    for r in records:
        if r.get("reached") and r.get("steps"):
            where = (str(r.get("run", "")), str(r["scenario"]))
            runs.setdefault(where, {}).setdefault(str(r["algorithm"]), []).append(int(r["steps"]))
    steps = {scenario: {o: statistics.median(n) for o, n in by.items()} for scenario, by in runs.items()}
    ratios: dict[str, list[float]] = {}
    for by_option in steps.values():
        if baseline not in by_option:
            continue
        for option, n in by_option.items():
            ratios.setdefault(option, []).append(n / by_option[baseline])
    return {option: statistics.median(values) for option, values in sorted(ratios.items())}


def read_step_ratios(path: str | Path, baseline: str = "allreduce") -> dict[str, float]:
    """:func:`step_ratios` of a bench/tta result file (``tta.jsonl``: a JSON record per line)."""
    with open(path) as f:
        return step_ratios((json.loads(line) for line in f if line.strip()), baseline)


# ---- the decision -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prediction:
    """One candidate's prediction."""

    key: str  # its name in the data (bench/tta's algorithm key)
    step_s: float  # seconds per step
    steps_ratio: float  # steps to the target relative to allreduce's
    replicas: int  # replicas that train on under it

    @property
    def score(self) -> float:
        """Seconds to the target per allreduce step it needs: what is compared."""
        return self.step_s * self.steps_ratio


@dataclass(frozen=True)
class Choice:
    """The decision: the candidate chosen, and what every candidate was predicted to take."""

    key: str
    predictions: list[Prediction] = field(default_factory=list)

    def predicted(self, key: str) -> Prediction:
        return next(p for p in self.predictions if p.key == key)


def decide(
    candidates: Mapping[str, Mapping[str, Any]],
    ratios: Mapping[str, float],
    measured: Measured,
    current: str | None = None,
    margin: float = 1.1,
) -> Choice:
    """The candidate (by key: ``candidates`` maps keys to ``sync`` sections) predicted to reach the target first,
    and every candidate's prediction. A candidate without a steps ratio in ``ratios`` is skipped; relaxed sync only
    where it would evict, or where it runs (where it would evict nobody, with its option's steps ratio: the data's
    own for relaxed sync counts the steps its eviction cost, which are spent). ``current`` (the option running) is
    kept unless another is predicted faster by ``margin`` (so that measurement noise does not make the run switch
    back and forth)."""
    predictions = []
    for key, section in candidates.items():
        if key not in ratios:
            continue
        ratio, replicas = ratios[key], len(kept(section, measured))
        if _evicts(section) is not None and replicas == measured.replicas:
            if key != current:
                continue  # (relaxed sync where it would evict nobody; the one running stays a candidate: it evicted)
            # (and trains on as its option alone: that option's steps ratio, not the one its eviction cost)
            inner = next((k for k, s in candidates.items() if s == section["inner"] and k in ratios), key)
            ratio = ratios[inner]
        ratio /= samples_share(section, measured)
        predictions.append(Prediction(key, step_seconds(section, measured), ratio, replicas))
    if not predictions:
        raise ValueError(f"no candidate of {sorted(candidates)} has a steps ratio in the data ({sorted(ratios)})")
    best = min(predictions, key=lambda p: p.score)
    held = next((p for p in predictions if p.key == current), None)
    if held is not None and best.score * margin > held.score:
        best = held
    return Choice(best.key, predictions)
