"""sync=auto: its model (the traffic of each option against what real runs counted, the steps ratios read from
bench/tta's recorded results, the choice on measured clusters) and its switches in a real run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_cfg, load_model_state, records, train, train_each

from algorithms.auto import DATA, AutoSync
from algorithms.auto.model import Measured, decide, kept, read_step_ratios, step_ratios, traffic
from algorithms.compress import TopK
from errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "bench" / "results" / "tta.jsonl"
PROBE = 1 << 20
LATENCY_S = 0.0005


def _candidates() -> dict[str, dict]:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(compose_cfg("sync=auto").sync.candidates, resolve=True)


def _tta_shapes() -> tuple[tuple[int, ...], ...]:
    """The tensors of bench/tta's model (experiment=tta: timm's test_resnet, digits' 10 classes)."""
    import timm

    return tuple(tuple(p.shape) for p in timm.create_model("test_resnet", num_classes=10).parameters())


def _records(scenario: str = "fleet") -> dict[str, dict]:
    """bench/tta's table (every option once at each cluster), as docs/benchmarks/tta.md shows it."""
    lines = (json.loads(line) for line in RUNS.read_text().splitlines() if line.strip())
    return {r["algorithm"]: r for r in lines if r["scenario"] == scenario}


def _cluster(compute_s, bandwidth, shapes=None) -> Measured:
    """Replicas computing ``compute_s`` seconds a step, behind links of ``bandwidth`` bytes/s (one or one each)."""
    bandwidth = bandwidth if isinstance(bandwidth, (list, tuple)) else [bandwidth] * len(compute_s)
    links = tuple(LATENCY_S + PROBE / b for b in bandwidth)
    return Measured(shapes or _tta_shapes(), tuple(compute_s), links, PROBE, LATENCY_S)


def test_traffic_is_what_the_runs_counted():
    """Each candidate's bytes per step, from the model's tensors and the option's settings, against what bench/tta's
    runs of that option counted (4 nodes): exact for allreduce, and for the periodic options over the averagings
    the run completed (BN statistics, averaged with the parameters, add under 1 %)."""
    shapes, runs, candidates = _tta_shapes(), _records(), _candidates()
    allreduce = runs["allreduce"]
    per_step = traffic(candidates["allreduce"], shapes).bytes_sent(4)
    assert per_step * allreduce["trained_steps"] == pytest.approx(allreduce["mb_per_node"] * 1e6, rel=1e-4)
    for key, period in (("localsgd4", 4), ("localsgd16", 16), ("diloco", 16)):
        section, run = candidates[key], runs[key]
        averagings = run["trained_steps"] // period
        predicted = traffic(section, shapes).bytes_sent(4) * period * averagings
        assert predicted == pytest.approx(run["mb_per_node"] * 1e6, rel=0.01), key
    # streaming DiLoCo: int8 travels gathered, a quarter of fp32's bytes and the blocks' scales, over H steps
    streaming = traffic(candidates["streaming"], shapes)
    params = sum(math.prod(s) for s in shapes)
    assert streaming.ring_bytes == 0 and streaming.overlapped
    assert streaming.gather_bytes * 32 == params + 8 * math.ceil(params / 1024)
    # SparseLoCo: the same schedule, each fragment's payload (segment_ranges' 4 cuts) as compress.TopK sizes it
    # (under 0.95 % of fp32's bytes: 0.92 % a whole chunk, and each fragment's last chunk is partial)
    sparse = traffic(candidates["sparse"], shapes)
    bounds = [round(i * params / 4) for i in range(5)]
    payloads = sum(TopK.of(b - a, 4096, 0.02).bytes for a, b in zip(bounds, bounds[1:]))
    assert sparse.ring_bytes == 0 and sparse.overlapped and sparse.gather_bytes * 32 == payloads
    assert payloads < 0.0095 * 4 * params and traffic(candidates["sparse_avg"], shapes) == sparse


def test_step_ratios_are_read_from_the_recorded_results(tmp_path):
    records_ = [
        {"scenario": "a", "algorithm": "allreduce", "reached": True, "steps": 64},
        {"scenario": "a", "algorithm": "x", "reached": True, "steps": 96},
        {"scenario": "b", "algorithm": "allreduce", "reached": True, "steps": 50},
        {"scenario": "b", "algorithm": "x", "reached": True, "steps": 100},
        {"scenario": "c", "algorithm": "x", "reached": True, "steps": 10},  # (no allreduce there: not counted)
        {"scenario": "a", "algorithm": "never", "reached": False, "steps": None},
    ]
    assert step_ratios(records_) == {"allreduce": 1.0, "x": 1.75}
    repeated = [  # (bench/tta --repeats: an option's runs in a scenario count as their median)
        *({"scenario": "d", "algorithm": "allreduce", "reached": True, "steps": n} for n in (60, 70)),
        *({"scenario": "d", "algorithm": "x", "reached": True, "steps": n} for n in (60, 90, 300)),
    ]
    assert step_ratios(repeated) == {"allreduce": 1.0, "x": 90 / 65}
    # Another bench run's scenario "d" (another CPU's seeds) sets its options against its own allreduce only.
    later = [
        {"run": "later", "scenario": "d", "algorithm": "allreduce", "reached": True, "steps": 80},
        {"run": "later", "scenario": "d", "algorithm": "y", "reached": True, "steps": 120},
    ]
    assert step_ratios([*repeated, *later]) == {"allreduce": 1.0, "x": 90 / 65, "y": 1.5}
    # The project's own: what bench/tta recorded at 5 seeds (bench/results/tta_ratios.md), the median steps of each.
    ratios = read_step_ratios(DATA)
    assert ratios["localsgd16"] == 70 / 68 and ratios["streaming"] == 72 / 68 and ratios["diloco"] == 110 / 68
    # The choice follows the data: the same cluster, with streaming DiLoCo's steps tripled in a copy of the results.
    slow_link = _cluster([0.038] * 4, 11.7e6)
    assert decide(_candidates(), ratios, slow_link).key == "streaming"
    copy = tmp_path / "tta.jsonl"
    lines = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    for r in lines:
        if r["algorithm"] == "streaming" and r["steps"]:
            r["steps"] *= 3
    copy.write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert decide(_candidates(), read_step_ratios(copy), slow_link).key == "localsgd16"
    auto = AutoSync(_candidates(), steps_data=str(copy))
    assert auto.ratios["streaming"] == 3 * 72 / 68


def test_sparseloco_is_chosen_where_only_its_bytes_keep_up():
    """SparseLoCo's steps ratio is the data's (its run beside an allreduce of its own: 98 steps against 66); at
    100 Mbit streaming DiLoCo's int8 rounds still hide behind compute and its fewer steps win, at 1 Mbit they take
    5x the pace, and SparseLoCo's payloads, under a hundredth of them, still hide: it is chosen."""
    ratios = read_step_ratios(DATA)
    assert ratios["sparse"] == 98 / 66 and "sparse_avg" not in ratios
    assert ratios["streaming"] == 72 / 68  # (the first run's candidates keep their own allreduce)
    assert decide(_candidates(), ratios, _cluster([0.051] * 4, 11.7e6), current="allreduce").key == "streaming"
    choice = decide(_candidates(), ratios, _cluster([0.051] * 4, 0.125e6), current="allreduce")
    assert choice.key == "sparse"
    sparse, streaming = choice.predicted("sparse"), choice.predicted("streaming")
    assert sparse.step_s == pytest.approx(0.051, rel=0.05)  # (its exchange hidden behind the pace)
    assert streaming.step_s > 4 * 0.051


@pytest.mark.parametrize(
    "compute_s, bandwidth, expected",
    [
        # (bench/tta's pace, a step without its exchange: 0.051 s, the sync=none cell's)
        ([0.051] * 4, 11.7e6, "streaming"),  # bench/tta (a): 100 Mbit, communication 4x the pace
        ([0.051] * 4, 117e6, "localsgd16"),  # (b): 1 Gbit, communication 0.4x the pace
        ([0.051, 0.153, 0.051, 0.051], [117e6] * 3 + [11.7e6], "relaxed_streaming"),  # (c): uneven
        ([0.2] * 4, 12.5e9, "allreduce"),  # 100 Gbit, a longer step: nothing beats allreduce by the margin
        ([0.038], 11.7e6, "allreduce"),  # one replica: nothing to send
    ],
)
def test_the_choice_on_measured_clusters(compute_s, bandwidth, expected):
    choice = decide(_candidates(), read_step_ratios(DATA), _cluster(compute_s, bandwidth), current="allreduce")
    assert choice.key == expected
    best = min(choice.predictions, key=lambda p: p.score)
    held = choice.predicted("allreduce")
    assert choice.key == best.key or best.score * 1.1 > held.score  # (kept within the margin only)


def test_bench_auto_model_ranks_the_candidates_at_each_link_rate():
    """bench/auto_model --links: at each rate the model's own choice first, the others by predicted time over it;
    the traffic that slower links price makes the choice send fewer bytes as the rate falls."""
    from bench.auto_model import by_link

    rows = by_link(DATA, RUNS, (10_000.0, 1000.0, 100.0, 10.0))
    assert [mbit for mbit, _ in rows] == [10_000.0, 1000.0, 100.0, 10.0]
    shapes, candidates, ratios = _tta_shapes(), _candidates(), read_step_ratios(DATA)
    # (even nodes: relaxed sync would evict nobody, so it is no candidate)
    priced = {k for k in candidates if k in ratios and not k.startswith("relaxed")}
    sent = []
    for _, ranked in rows:
        assert ranked[0][1] == 1.0 and all(r >= 1.0 for _, r in ranked[1:])
        assert [r for _, r in ranked[1:]] == sorted(r for _, r in ranked[1:])
        assert {k for k, _ in ranked} == priced
        sent.append(traffic(candidates[ranked[0][0]], shapes).bytes_sent(4))
    assert sent == sorted(sent, reverse=True) and sent[-1] < sent[0]
    # and the rate the model prices most: at 10 Mbit local SGD k=16's averaging costs it several times streaming
    # DiLoCo's time (3.7x at the recorded pace), which overlaps its int8 fragments with the compute
    assert rows[-1][1][0][0] == "streaming" and dict(rows[-1][1])["localsgd16"] > 2


def test_sync_auto_reads_the_second_jobs_recorded_steps_ratios():
    """bench/tta's second job (``--job tta_hard``) records its own steps ratios; pointed there by ``sync.steps_data``
    sync=auto prices its candidates by them: on that job local SGD k=16 costs half again allreduce's steps (none on
    the first), DiLoCo and streaming DiLoCo never reached the target (no candidate there), on that job's 1 Gbit
    cluster the choice differs from the first job's (local SGD k=4 there, k=16 by the first job's ratios), and on
    its uneven cluster relaxed sync over DiLoCo with averaging, the uneven row's first, is priced first."""
    from bench.tta import JOBS
    from engine.config import prepare

    data = ROOT / JOBS["tta_hard"].ratios
    hard, first = read_step_ratios(data), read_step_ratios(DATA)
    assert hard["localsgd16"] >= 1.3 > first["localsgd16"]
    assert "streaming" not in hard and "diloco" not in hard and "streaming" in first
    plain = prepare(compose_cfg("experiment=tta_hard", "sync=auto", f"sync.steps_data={data}"))
    from hydra.utils import instantiate

    auto = instantiate({k: v for k, v in plain["sync"].items() if k != "scope"})  # (as engine.scope.build_sync)
    assert isinstance(auto, AutoSync) and auto.ratios == hard
    gbit = _cluster([0.073] * 4, 117e6)  # (the job's pace: its sync=none cell's step; 1 Gbit through tbf)
    assert decide(_candidates(), hard, gbit).key != decide(_candidates(), first, gbit).key
    # with the job's own candidates added as bench/tta's auto cell adds them: gossip, which needs fewer steps than
    # allreduce there and overlaps its exchange, is priced first on its 1 Gbit cluster
    from bench.tta import job_candidates

    own = prepare(compose_cfg("experiment=tta_hard", "sync=auto", *job_candidates(JOBS["tta_hard"], 4)))
    assert decide(own["sync"]["candidates"], hard, gbit).key == "sgp_overlap" != decide(_candidates(), hard, gbit).key
    # The uneven row's relaxed cells are in the data, what their evictions cost in steps (relaxed sync over DiLoCo
    # with averaging: half again allreduce's); on the uneven cluster (a node 3x slower, one behind 100 Mbit) it is
    # priced first, as it ran first there (48.5 s, 2.7x faster than allreduce), ahead of gossip alone
    assert hard["relaxed_diloco_avg"] > 1.3 and hard["relaxed_allreduce"] < hard["relaxed_link_allreduce"]
    uneven = _cluster([0.073, 0.219, 0.073, 0.073], [117e6] * 3 + [11.7e6])
    choice = decide(own["sync"]["candidates"], hard, uneven)
    assert choice.key == "relaxed_diloco_avg"
    assert choice.predicted("relaxed_diloco_avg").score < choice.predicted("sgp_overlap").score


def test_relaxed_candidates_only_where_they_would_evict():
    candidates, ratios = _candidates(), read_step_ratios(DATA)
    even = _cluster([0.038] * 4, 117e6)
    assert not any(p.key.startswith("relaxed") for p in decide(candidates, ratios, even).predictions)
    slow_node = _cluster([0.038, 0.114, 0.038, 0.038], 117e6)
    assert kept(candidates["relaxed_allreduce"], slow_node) == [0, 2, 3]
    assert kept(candidates["relaxed_link_allreduce"], slow_node) == [0, 1, 2, 3]
    slow_link = _cluster([0.038] * 4, [117e6] * 3 + [11.7e6])
    assert kept(candidates["relaxed_link_allreduce"], slow_link) == [0, 1, 2]
    assert kept(candidates["relaxed_allreduce"], slow_link) == [0, 1, 2, 3]
    # Once relaxed sync has evicted the slow node the cluster is even: the one running is kept, as its option alone
    # would be (the same prediction), rather than dropped for it at the cost of a switch.
    after = _cluster([0.038] * 3, 11.7e6)
    choice = decide(candidates, ratios, after, current="relaxed_streaming")
    assert choice.key == "relaxed_streaming"
    assert choice.predicted("relaxed_streaming").score == choice.predicted("streaming").score


def test_decoupled_is_priced_at_the_median_pace_over_the_steps_it_computes():
    """sync=decoupled catching up: the median replica's pace (a learner 3x slower computes one step in 3, so 4
    learners compute 3 + 1/3 of 4 steps: its data's steps ratio over 10/12), streaming DiLoCo's bytes and 40 of
    headers per learner and round; without catching up, the slowest's pace and every step."""
    from algorithms.auto.model import samples_share, step_seconds

    candidates = _candidates()
    streaming = candidates["streaming"]
    decoupled = {**streaming, "_target_": "algorithms.decoupled.DecoupledDiLoCo", "catch_up": True}
    shapes, rounds = _tta_shapes(), 4 / 32  # (4 fragments, H = 32: a round every 8 steps)
    assert traffic(decoupled, shapes).bytes_sent(4) == pytest.approx(
        traffic(streaming, shapes).bytes_sent(4) + 3 * 40 * rounds, rel=1e-12
    )
    slow = _cluster([0.073, 0.219, 0.073, 0.073], 117e6)
    assert samples_share(decoupled, slow) == pytest.approx((3 + 1 / 3) / 4)
    assert step_seconds(decoupled, slow) == pytest.approx(0.073)  # (its exchange overlapped, well within a step)
    assert step_seconds(streaming, slow) == pytest.approx(0.219)
    choice = decide({"decoupled": decoupled, "streaming": streaming}, {"decoupled": 1.1, "streaming": 1.1}, slow)
    assert choice.predicted("decoupled").steps_ratio == pytest.approx(1.1 * 12 / 10)
    assert choice.key == "decoupled"
    waits = {**decoupled, "catch_up": False}
    assert samples_share(waits, slow) == 1.0 and step_seconds(waits, slow) == pytest.approx(0.219)
    even = _cluster([0.073] * 4, 117e6)
    assert samples_share(decoupled, even) == 1.0 and step_seconds(decoupled, even) == step_seconds(streaming, even)
    noisy = _cluster([0.073, 0.073 * 1.2, 0.073, 0.073], 117e6)  # (within the tolerance: every step computed)
    assert samples_share(decoupled, noisy) == 1.0


def test_bad_auto_settings_are_named():
    from engine.config import prepare

    for override, key in (
        ("sync.probe_steps=0", "sync.probe_steps"),
        ("sync.margin=0.5", "sync.margin"),
        ("sync.start=sgp", "sync.start"),
        ("sync.steps_data=/nonexistent/tta.jsonl", "sync.steps_data"),
        ("sync.candidates.localsgd4.k_steps=0", "sync.candidates.localsgd4.k_steps"),
    ):
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            prepare(compose_cfg("sync=auto", override))


SWITCHED = ["allreduce", "localsgd4", "localsgd16", "diloco", "streaming", "relaxed_allreduce", "relaxed_streaming"]


def euler_circuit(nodes: list[str]) -> list[str]:
    """A walk through every ordered pair of ``nodes`` once (an Euler circuit of the complete digraph)."""
    edges = {a: [b for b in nodes if b != a] for a in nodes}
    stack, walk = [nodes[0]], []
    while stack:
        here = stack[-1]
        if edges[here]:
            stack.append(edges[here].pop())
        else:
            walk.append(stack.pop())
    return walk[::-1]


def switch_walk(tmp_path, walk: list[str], *overrides: str) -> tuple[list[dict], list[dict]]:
    """A real run of 2 processes whose sync=auto, once its probe (3 steps) has decided, switches to ``walk``'s first
    candidate and then every 2 steps to the next (``_workers.auto_switch_walk``): its switches' log and its records,
    after asserting that it made the walk's switches, that the replicas held identical parameters after each, and
    that every step is recorded once."""
    from _workers import auto_switch_walk

    (tmp_path / "walk.json").write_text(json.dumps(walk))
    probe, every = 3, 2
    steps = probe + every * len(walk)
    _, metrics = train(
        tmp_path, *FAST, "sync=auto", f"sync.probe_steps={probe}", f"trainer.max_steps={steps}",
        "sync.check_every=100000",  # (no drift decision between the switches the walk makes)
        *overrides, entrypoint=auto_switch_walk,
    )  # fmt: skip
    log = json.loads((tmp_path / "switches.json").read_text())
    assert [e["to"] for e in log] == walk[1:]
    assert all(e["identical"] for e in log), [e for e in log if not e["identical"]]
    trained = [r["step"] for r in records(metrics, "train")]
    assert sorted(trained) == list(range(steps)) and len(set(trained)) == len(trained)
    return log, metrics


def test_every_switch_keeps_each_step_once_and_the_replicas_in_agreement(tmp_path):
    """A real run of 2 processes whose sync=auto is made to switch through every ordered pair of its candidates,
    two steps apart: after each switch the replicas hold identical parameters, every step is recorded once, and the
    run ends with replicas that agree after the last evaluation's averaging."""
    walk = euler_circuit(SWITCHED)
    assert len(walk) == len(SWITCHED) * (len(SWITCHED) - 1) + 1
    log, metrics = switch_walk(
        tmp_path, walk, "sync.candidates.relaxed_allreduce.relaxed_sync_threshold=1000",
        "sync.candidates.relaxed_streaming.relaxed_sync_threshold=1000",
    )  # fmt: skip
    # An option that keeps the replicas identical at every step (by exchanging gradients) still does 2 steps after
    # a switch into it from local steps: the settle averaged the optimizer's momenta too.
    # Relaxed sync goes around the option running, or comes off it, and that option goes on with its own state.
    wraps = {("allreduce", "relaxed_allreduce"), ("streaming", "relaxed_streaming")}
    assert [e for e in log if e["kept"] != ((e["from"], e["to"]) in wraps or (e["to"], e["from"]) in wraps)] == []
    assert sum(e["kept"] for e in log) == 4
    every_step = [e for e in log if e["from"] in ("allreduce", "relaxed_allreduce")]
    assert len(every_step) == 12 and all(e["stayed"] for e in every_step), [e for e in every_step if not e["stayed"]]
    chosen = [r for r in records(metrics, "event") if r.get("event") == "sync_chosen"]
    assert chosen and chosen[0]["why"] == "probe" and chosen[0]["at_steps"] == 3


def test_switches_into_and_out_of_gossip_and_diloco_with_plain_averaging(tmp_path):
    """The second bench job's own candidates (gossip with overlap, DiLoCo with plain averaging, relaxed sync over
    gossip), added as bench/tta adds them, switched through every ordered pair with allreduce: gossip's rounds in
    flight are drained and the replicas agree after each switch; relaxed sync goes around gossip and comes off it
    with gossip's state kept; every step is recorded once."""
    from bench.tta import OPTIONS, RELAXED, as_candidate

    extra = ["sgp_overlap", "diloco_avg", "relaxed_sgp_overlap"]
    added = [o for key in extra for o in as_candidate(key, (OPTIONS | RELAXED)[key][1])]
    log, _ = switch_walk(
        tmp_path, euler_circuit(["allreduce", *extra]), *added,
        "sync.candidates.relaxed_sgp_overlap.relaxed_sync_threshold=1000",
    )  # fmt: skip
    wraps = {("sgp_overlap", "relaxed_sgp_overlap"), ("relaxed_sgp_overlap", "sgp_overlap")}
    assert [e for e in log if e["kept"] != ((e["from"], e["to"]) in wraps)] == []
    assert sum(e["kept"] for e in log) == 2
    gossip = [e for e in log if e["from"] in ("sgp_overlap", "relaxed_sgp_overlap")]  # (replicas that gossiped apart)
    assert len(gossip) == 6 and not any(e["stayed"] for e in gossip)


def test_an_option_that_averages_models_takes_the_probes_steps_as_its_first_period(tmp_path):
    """Chosen after the probe, local SGD (k=4) and DiLoCo (H=4) start from the parameters the replicas agreed on
    before it, without averaging them first: the run is the option's own from step 0, the same arithmetic in the
    same order, so its model equals, to the bit, that of a run of the option alone. (Averaged at the switch, at
    step 2, the replicas would part from that run's there.)"""
    common = [*FAST, "trainer.nproc=2", "data=digits", "optimizer=momentum", "trainer.max_steps=6",
              "trainer.checkpoint_every=0", "data.batch_size=16"]  # fmt: skip
    auto = ["sync=auto", "sync.probe_steps=2", "sync.margin=1000"]  # (the start option is kept: it is chosen)
    runs = {
        "auto_localsgd": [*common, *auto, "sync.start=localsgd4"],
        "localsgd": [*common, "sync=localsgd", "sync.begin_step=0", "sync.k_steps=4"],
        "auto_diloco": [*common, *auto, "sync.start=diloco", "sync.candidates.diloco.inner_steps=4"],
        "diloco": [*common, "sync=diloco", "sync.inner_steps=4"],
    }
    metrics = train_each(tmp_path, runs)
    for option in ("localsgd", "diloco"):
        chosen = [r for r in records(metrics[f"auto_{option}"], "event") if r.get("event") == "sync_chosen"]
        assert [(c["option"], c["at_steps"]) for c in chosen] == [(f"{option}4" if option == "localsgd" else option, 2)]
        ours, theirs = load_model_state(tmp_path / f"auto_{option}"), load_model_state(tmp_path / option)
        assert ours.keys() == theirs.keys()
        assert [k for k in ours if not torch.equal(ours[k], theirs[k])] == []
    synced = [r["step"] for r in records(metrics["auto_localsgd"], "train") if r.get("synced")]
    assert synced == [3], synced  # (k=4 from step 0: the probe's 2 steps were the first 2 of 4)


def test_relaxed_sync_chosen_for_a_straggler_evicts_it_at_once(tmp_path):
    """The probe measures one of 3 ranks at 4x the others' pace: sync=auto chooses relaxed sync for whom it would
    evict, and relaxed sync's check runs in the same step, with the pace just measured (not 10 steps later, at its
    own); the survivors train on, without a decision again: the one that evicted predicted them."""
    probe = 3
    _, metrics = train(
        tmp_path, *FAST, "trainer.nproc=3", "data=digits", "sync=auto", f"sync.probe_steps={probe}",
        "trainer.max_steps=8", "straggler=sleep", "straggler.ranks=[2]", "straggler.start_epoch=1",
        "straggler.slowdown=4",
    )  # fmt: skip
    events = records(metrics, "event")
    chosen = [r for r in events if r.get("event") == "sync_chosen"]
    assert chosen[0]["at_steps"] == probe and chosen[0]["option"].startswith("relaxed_"), chosen[0]
    assert chosen[0]["predicted"][chosen[0]["option"]]["replicas"] == 2
    (evict,) = [r for r in events if r.get("event") == "evict"]
    assert evict["ranks"] == [2] and "as sync=auto chose it" in evict["message"]
    assert evict["step"] == probe - 1  # (in the probe's last step, as it decided)
    assert len(chosen) == 1, chosen[1:]  # (the eviction it chose relaxed sync for: no new measurement of the rest)
    steps = records(metrics, "train")
    assert {r["world_size"] for r in steps if r["step"] >= probe} == {2}
    assert sorted(r["step"] for r in steps) == list(range(8))


class _Gathers:
    """What ``_drift`` asks of the communicator: an all-gather of each rank's (mean step, latest steps' median, pace);
    here the others' are given."""

    device = "cpu"

    def __init__(self, others: list[tuple[float, float, float]]):
        self.others = others

    def all_gather(self, tensor):
        return [tensor] + [torch.tensor(t, dtype=torch.float64) for t in self.others]


def test_a_step_time_that_drifts_from_the_prediction_decides_again():
    """The drift check reads the slowest rank's mean step (the first after a decision left out) against the one
    predicted: 1.5x or more, or under 1/1.5, says why; within, says nothing."""
    from types import SimpleNamespace

    auto = AutoSync(_candidates())
    auto.key, auto.predicted_s = "localsgd16", 0.040
    auto.ctx = SimpleNamespace(comm=_Gathers([(0.041, 0.041, 0.035)]))
    auto._steps, auto._pace = [0.5, 0.040, 0.042], [0.5, 0.035, 0.036]  # (the first, a setup, left out)
    assert auto._drift() is None
    auto.ctx = SimpleNamespace(comm=_Gathers([(0.130, 0.130, 0.125)]))  # another rank slowed 3x
    why, measured = auto._drift()
    assert "3.25x the 0.040 s predicted" in why and measured is None  # (no measurement to go by: measure)
    auto.ctx = SimpleNamespace(comm=_Gathers([(0.010, 0.010, 0.008)]))
    auto._steps = [0.5, 0.010, 0.010]  # faster than predicted by 4x (a straggler left)
    assert "0.25x" in auto._drift()[0]
    # A rank slowed 3x in the window's last 2 of 9 steps: its mean, 1.4x, does not cross 1.5x; its latest 3 steps'
    # median (0.120 s, 3x) does.
    auto._steps = [0.5] + [0.040] * 7 + [0.120] * 2  # (this rank's; the other's as predicted)
    auto.ctx = SimpleNamespace(comm=_Gathers([(0.041, 0.041, 0.035)]))
    assert sum(auto._steps[1:]) / 9 / 0.040 < 1.5
    assert "3.00x the 0.040 s predicted" in auto._drift()[0]


def test_a_drift_the_paces_explain_is_decided_without_probing_the_links():
    """After a decision, the drift check gathers each rank's pace with its step times. Where a rank's pace rose 3x and
    the option running (streaming DiLoCo, its exchange behind the compute) predicts the latest steps by the new paces
    and the links last measured, the decision takes those (relaxed sync, evicting the slow rank) without a link
    probe; where the paces stayed and the steps slowed (a link dropped), it measures anew."""
    from types import SimpleNamespace

    candidates = _candidates()
    before = _cluster([0.038] * 4, [117e6] * 3 + [11.7e6])  # (c)'s links, no straggler yet
    auto = AutoSync(candidates)
    auto.key, auto._measured = "streaming", before
    auto.predicted_s = predicted = decide(candidates, auto.ratios, before).predicted("streaming").step_s
    auto._steps, auto._pace = [0.5] + [predicted] * 4, [0.5] + [0.038] * 4
    slow = 3 * 0.038 + 0.004  # (its step: its pace, and a little of the exchange not hidden)
    others = [(slow, slow, 3 * 0.038), (predicted, predicted, 0.038), (predicted, predicted, 0.038)]
    auto.ctx = SimpleNamespace(comm=_Gathers(others))  # (rank 1 slowed 3x)
    why, measured = auto._drift()
    assert "the paces explain it" in why
    assert measured.compute_s == (0.038, 3 * 0.038, 0.038, 0.038) and measured.link_s == before.link_s
    assert decide(candidates, auto.ratios, measured, current="streaming").key == "relaxed_streaming"
    # The paces as they were, every step 3x longer: they do not explain it; the links are measured again.
    auto.ctx = SimpleNamespace(comm=_Gathers([(3 * predicted, 3 * predicted, 0.038)] * 3))
    auto._steps = [0.5] + [3 * predicted] * 4
    why, measured = auto._drift()
    assert "explain" not in why and measured is None
