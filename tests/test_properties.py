"""Properties every plan of every search must have, on random valid models and clusters (tests/strategies.py).

Each property runs twice: `ci` (part of the default `pytest -q`, derandomized, about 660 examples in all)
and `slow` (10,000 examples in all with tests/test_properties_dataparallel.py, a fresh random seed each run),
selected with

    python -m pytest -m slow -p no:cacheprovider tests/test_properties.py tests/test_properties_dataparallel.py

A failure prints the shrunk falsifying `spec` (the model, cluster and profile efficiencies) and a
@reproduce_failure blob that replays it.
"""

from __future__ import annotations

import csv
import json
import math
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from simulate import simulate_1f1b, simulate_interleaved_1f1b
from strategies import ExplicitPlan, Spec, Written, explicit_plans, specs, write

from fasop.cli import main
from fasop.cost.config import chunk_layers
from fasop.plans import CSV_LIST_SEPARATOR, load_plans, write_plans
from fasop.search import estimate, search_plans, search_within_headroom
from fasop.search.engine import SORT_KEYS

RELATIVE_TOLERANCE = 1e-9  # figures recomputed along another path may differ in the last bits
ESTIMATED_PLANS = 100  # plans of one search re-estimated (evenly spread over the ranking when there are more)


def examples(ci: int, slow: int):
    """Run a property `ci` times in the default run (the same examples every time) and `slow` times, from a
    fresh random seed, under `-m slow`."""
    return pytest.mark.parametrize("max_examples, derandomize", [
        pytest.param(ci, True, id="ci"), pytest.param(slow, False, id="slow", marks=pytest.mark.slow)])


def check(max_examples: int, derandomize: bool, prop, *strategies, found: tuple[tuple, ...] = ()) -> None:
    """Run `prop` on `strategies`, and first on the arguments `found` (shrunk counterexamples of earlier runs);
    searches have no deadline (their time varies with the cluster)."""
    configured = settings(max_examples=max_examples, derandomize=derandomize, deadline=None, database=None,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    test = given(*strategies)(prop)
    for args in found:
        test = example(*args)(test)
    configured(test)()


# -- counterexamples the random runs found and shrank: a tiny model and nodes of A10s, 2.72 GiB each -----------
def tiny_model(architecture: str, gbs: int, position_embedding: str = "learned", **shape) -> dict:
    return {"name": "0", "architecture": architecture, **shape, "hidden_size": 32, "num_attention_heads": 1,
            "num_query_groups": 1, "ffn_hidden_size": 64, "vocab_size": 1000, "tie_embeddings": False,
            "position_embedding": position_embedding, "normalization": "layernorm", "ffn_activation": "gelu",
            "flash_attention": False, "dropout": False, "linear_bias": False, "precision": "fp16",
            "global_batch_size": gbs}


def a10_nodes(name: str, count: int, gpus_per_node: int = 1, intra_node_bandwidth: str = "1.319e+09B/s") -> dict:
    return {"name": name, "gpu": "A10", "gpus_per_node": gpus_per_node, "gpu_memory_gib": 2.72,
            "intra_node_bandwidth": intra_node_bandwidth, "inter_node_bandwidth": "2.415e+07B/s",
            "price_per_hour_usd": 0.0, "count": count}


def tiny_spec(model: dict, *nodes: dict) -> Spec:
    return Spec(model, {"name": "0", "memory_margin": 1.0}, list(nodes), {"A10": 0.05})


ENCODER_DECODER_SEQUENCES = {"encoder_seq_length": 64, "decoder_seq_length": 32}
# generous links inside the nodes: the partition of the best plans holds 3 of the 4 layers
LAYERS_LOST = tiny_spec(tiny_model("encoder-decoder", 6, "rope", encoder_num_layers=1, decoder_num_layers=3,
                                   **ENCODER_DECODER_SEQUENCES),
                        a10_nodes("0", 1, 2, "2.146e+14B/s"), a10_nodes("1", 2, 2, "2.146e+14B/s"))
# the full search finds 3 plans, the pruned one with keep=3 only 2
PRUNED_TOO_FEW = tiny_spec(tiny_model("encoder-decoder", 3, encoder_num_layers=2, decoder_num_layers=2,
                                      **ENCODER_DECODER_SEQUENCES), a10_nodes("a", 3))
# with keep=2 the pruned search returns the full search's third plan second
PRUNED_WRONG_PLAN = tiny_spec(tiny_model("encoder-decoder", 7, encoder_num_layers=2, decoder_num_layers=6,
                                         encoder_seq_length=64, decoder_seq_length=64), a10_nodes("a", 7))
# a node type whose name holds "-", which the CSV plan file once used to join placements
DASHED_NODE_TYPE = tiny_spec(tiny_model("decoder", 1, num_layers=1, seq_length=64), a10_nodes("0-", 1))
# the best plan is interleaved (two model chunks per stage): `fasop estimate` must be told its virtual stages
INTERLEAVED_BEST = Spec(tiny_model("decoder", 3, num_layers=7, seq_length=256), {"name": "0", "memory_margin": 1.0},
                        [{**a10_nodes(name, 1), "gpu": gpu, "inter_node_bandwidth": "6.566e+07B/s"}
                         for name, gpu in (("0", "A100"), ("1", "A10"), ("2", "A100"))], {"A10": 0.05, "A100": 0.05})


def written(spec, root: str) -> Written:
    return write(spec, Path(root))


def close(a, b) -> bool:
    """Equal, with floats (also nested in lists and dicts) equal up to RELATIVE_TOLERANCE."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(
            a, b, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-15)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    return a == b


def differing_keys(a: dict, b: dict) -> dict:
    return {k: (a.get(k), b.get(k)) for k in sorted(a.keys() | b.keys()) if not close(a.get(k), b.get(k))}


def identity(plan: dict) -> tuple:
    return (plan["tp"], plan["dp"], plan["pp"], plan["mbs"], plan["encoder_stages"], tuple(plan["placement"]),
            tuple(plan["layers_per_stage"]))


# -- invariants of one plan -------------------------------------------------------------------------------------
def check_plan(plan: dict, w: Written, gbs: int) -> None:
    model, cluster = w.model, w.cluster
    gpn, tp, dp, pp, mbs = cluster.gpus_per_node, plan["tp"], plan["dp"], plan["pp"], plan["mbs"]
    placement, layers, stages = plan["placement"], plan["layers_per_stage"], plan["stages"]
    # GPUs: the plan's degrees use exactly the GPUs of its nodes, and the nodes exist in the cluster
    assert tp * dp * pp == len(placement) * gpn, plan
    assert gpn % tp == 0, plan
    assert all(placement.count(n) <= cluster.node_types[n].count for n in set(placement)), plan
    # every layer held exactly once
    assert len(layers) == pp and [s["layers"] for s in stages] == layers, plan
    assert sum(layers) == model.num_layers, (layers, model.num_layers)
    assert all(n >= 0 for n in layers), layers
    if model.is_encoder_decoder and pp > 1:
        e = plan["encoder_stages"]
        assert 1 <= e < pp, plan
        assert sum(layers[:e]) == model.encoder_num_layers, (layers, e, model.encoder_num_layers)
        assert sum(layers[e:]) == model.decoder_num_layers, (layers, e, model.decoder_num_layers)
        assert all(n >= 1 for n in layers), layers
    else:
        assert plan["encoder_stages"] == 0, plan
        assert all(n >= 1 for n in layers[1:-1]), layers  # only the ends may hold just the embedding or head
    # recomputation and sequence parallelism: full recomputation is searched as uniform over every layer
    assert plan["sequence_parallel"] == (tp > 1), plan
    assert (plan.get("recompute_method"), plan.get("recompute_num_layers")) == (
        ("uniform", 1) if plan["recompute"] == "full" else (None, None)), plan
    # each stage recomputes in its chunks, full recomputation every layer's forward (but where the embedding or
    # the head shares a chunk: docs/cost-model.md section 10)
    ends = {(0, 0), (pp - 1, plan["virtual_stages"] - 1), (plan["encoder_stages"], 0)}
    for i, (stage, chunks) in enumerate(zip(stages, stage_chunks(plan))):
        assert close(stage["recompute_s"], sum(times["recompute_s"] for _, times in chunks)), (i, stage)
        for j, (_, times) in enumerate(chunks):
            if plan["recompute"] == "none" or (plan["recompute"] == "full" and (i, j) not in ends):
                assert close(times["recompute_s"], 0.0 if plan["recompute"] == "none" else times["forward_s"]), (i, j)
    # the batch
    assert plan["gbs"] == gbs and plan["num_microbatches"] * dp * mbs == gbs, plan
    # memory: margin x memory + the fixed overhead fits the smallest GPU of every stage (docs/cost-model.md section 8)
    assert len(stages) == pp and [s["stage"] for s in stages] == list(range(pp))
    assert set().union(*(s["nodes"] for s in stages)) == set(range(len(placement))), plan
    for s in stages:
        nodes = {placement[i] for i in s["nodes"]}
        assert s["memory_capacity_gib"] == min(cluster.node_types[n].gpu_memory_gib for n in nodes), s
        assert s["gpu"] == "+".join(sorted({cluster.node_types[n].gpu for n in nodes})), s
        need = s["memory_gib"] * cluster.memory_margin + cluster.gpu_memory_overhead_gib
        assert s["memory_gib"] > 0 and need <= s["memory_capacity_gib"] * (1 + 1e-12), (s, cluster.memory_margin)
    loads = [s["memory_gib"] / s["memory_capacity_gib"] for s in stages]
    worst = stages[loads.index(max(loads))]
    assert (plan["peak_memory_gib"], plan["memory_capacity_gib"]) == (worst["memory_gib"], worst["memory_capacity_gib"])
    # figures (docs/cost-model.md section 7)
    step = plan["step_time_s"]
    assert 0 < step < math.inf
    # each stage reduces, steps and gathers after its last backward, hiding what it can: the step lies between
    # the pipeline and the pipeline followed by the slowest reduction and optimizer step (docs/cost-model.md 5, 7)
    floor = plan["pipeline_time_s"] + plan["embedding_allreduce_s"]
    assert floor * (1 - 1e-9) <= step <= (floor + plan["dp_allreduce_s"] + plan["optimizer_s"]) * (1 + 1e-9), plan
    assert step <= plan["closed_form_step_s"] * (1 + 1e-9) or plan["overlap_grad_reduce"], plan
    assert close(plan["dp_allreduce_s"], max(s["dp_allreduce_s"] for s in stages)), plan
    assert close(plan["throughput_samples_per_s"], gbs / step) and close(plan["tokens_per_s"], gbs * model.seq_length / step)
    price = sum(cluster.node_types[n].price_per_hour_usd for n in placement)
    assert close(plan["cost_per_hour_usd"], price) and close(plan["cost_per_step_usd"], price * step / 3600), plan


def check_ranking(plans: list[dict], sort: str) -> None:
    assert [p["rank"] for p in plans] == list(range(1, len(plans) + 1))
    keys = [p[SORT_KEYS[sort]] for p in plans]
    assert keys == sorted(keys), keys
    # one plan per (degrees, micro-batch size, placement): encoder splits are alternatives of one plan
    assert len({identity(p)[:4] + identity(p)[5:6] for p in plans}) == len(plans), "a plan is listed twice"


def estimated_fields(plan: dict) -> dict:
    """What `fasop estimate` must reproduce: everything but the rank and how the search found the placement (and
    the integer program's bound on how far a better one could be, which only a search computes)."""
    return {k: v for k, v in plan.items() if k not in ("rank", "placement_search", "optimality_gap")}


RECOMPUTE_FIELDS = ("recompute", "recompute_method", "recompute_num_layers", "sequence_parallel")


def recompute_options(plan: dict) -> list[str]:
    """The `fasop estimate` options of the plan's model chunks, recomputation and sequence parallelism."""
    options = ["--virtual-stages", str(plan["virtual_stages"]), "--recompute", plan["recompute"]]
    if "recompute_method" in plan:
        options += ["--recompute-method", plan["recompute_method"], "--recompute-num-layers", str(plan["recompute_num_layers"])]
    return options + ["--sequence-parallel" if plan["sequence_parallel"] else "--no-sequence-parallel",
                      "--tp-comm-overlap" if plan.get("tp_comm_overlap") else "--no-tp-comm-overlap"]


def check_estimate(plan: dict, w: Written) -> None:
    """`fasop estimate` of the plan's degrees, placement, layers and recomputation gives the plan's own figures."""
    row = estimated_fields(estimate(w.model, w.cluster, tp=plan["tp"], dp=plan["dp"], pp=plan["pp"], mbs=plan["mbs"],
                   placement=plan["placement"], layers_per_stage=plan["layers_per_stage"], gbs=plan["gbs"],
                   profiles_dir=str(w.profiles), distributed_optimizer=plan["distributed_optimizer"],
                   overlap_grad_reduce=plan["overlap_grad_reduce"], virtual_stages=plan["virtual_stages"],
                   tp_comm_overlap=bool(plan.get("tp_comm_overlap")),
                   **{key: plan.get(key) for key in RECOMPUTE_FIELDS}).record())
    assert row.pop("fits_memory") is True, plan
    expected = estimated_fields(plan)
    assert close(row, expected), differing_keys(row, expected)


# -- the properties ---------------------------------------------------------------------------------------------
@examples(ci=120, slow=2500)
def test_every_plan_is_sound_and_estimate_reproduces_it(max_examples, derandomize):
    def prop(spec, sort):
        with tempfile.TemporaryDirectory() as root:
            w = written(spec, root)
            found = search_plans(w.model, w.cluster, profiles_dir=str(w.profiles), sort=sort, workers=1).plans
            plans = [plan.record() for plan in found]
            check_ranking(plans, sort)
            for plan in plans:
                check_plan(plan, w, spec.gbs)
            for plan in plans[::max(1, -(-len(plans) // ESTIMATED_PLANS))]:
                check_estimate(plan, w)
            if plans:
                path = Path(root) / "plans.json"
                write_plans(found, path)
                assert load_plans(path) == found  # the JSON plan file round-trips exactly
                assert [plan.record() for plan in load_plans(path)] == plans

    check(max_examples, derandomize, prop, specs(), st.sampled_from(sorted(SORT_KEYS)), found=((LAYERS_LOST, "time"),))


@examples(ci=120, slow=2500)
def test_pruned_search_finds_the_same_best_plans(max_examples, derandomize):
    def prop(spec, keep, sort):
        with tempfile.TemporaryDirectory() as root:
            w = written(spec, root)
            full = [p.record() for p in search_plans(w.model, w.cluster, profiles_dir=str(w.profiles), sort=sort,
                                                     workers=1).plans]
            pruned = [p.record() for p in search_plans(w.model, w.cluster, profiles_dir=str(w.profiles), sort=sort,
                                                       workers=1, keep=keep).plans]
            assert [identity(p) for p in pruned] == [identity(p) for p in full[:keep]], (len(full), keep)
            for a, b in zip(pruned, full):
                assert close(a, b), differing_keys(a, b)

    check(max_examples, derandomize, prop, specs(), st.integers(1, 6), st.sampled_from(sorted(SORT_KEYS)),
          found=((PRUNED_TOO_FEW, 3, "time"), (PRUNED_WRONG_PLAN, 2, "time")))


@examples(ci=60, slow=1200)
def test_command_line_search_writes_the_plans_of_the_api(max_examples, derandomize):
    def prop(spec, sort, prune_top, suffix):
        with tempfile.TemporaryDirectory() as root:
            w = written(spec, root)
            output = Path(root) / f"plans{suffix}"
            options = ["--sort", sort, "--output", str(output)]
            if prune_top:
                options += ["--prune", "--top", str(prune_top)]
            result = CliRunner().invoke(main, ["search", *w.args(*options)])
            api = [p.record() for p in search_within_headroom(w.model, w.cluster, profiles_dir=str(w.profiles),
                                                              sort=sort, places=prune_top,
                                                              bound_placements=prune_top or 10).plans]  # --top
            if not api:  # nothing fits: one line, exit code 2, no output file
                assert result.exit_code == 2, result.output
                assert result.stderr.count("\n") == 1 and "no plan fits" in result.stderr, result.stderr
                assert not output.exists()
                return
            assert result.exit_code == 0, result.output
            if suffix == ".json":
                plans = [p.record() for p in load_plans(output)]
                assert len(plans) == len(api) and all(close(a, b) for a, b in zip(plans, api)), "CLI and API differ"
                best = plans[0]
                layers = ",".join(map(str, best["layers_per_stage"]))
                shown = CliRunner().invoke(main, ["estimate", *w.args(
                    "--tp", str(best["tp"]), "--dp", str(best["dp"]), "--pp", str(best["pp"]), "--mbs", str(best["mbs"]),
                    "--placement", ",".join(best["placement"]), "--layers", layers, *recompute_options(best), "--json")])
                assert shown.exit_code == 0, shown.output
                row = estimated_fields(json.loads(shown.stdout))
                assert row.pop("fits_memory") is True
                expected = estimated_fields(best)
                assert close(row, expected), differing_keys(row, expected)
            else:
                with open(output, newline="") as handle:
                    rows = list(csv.DictReader(handle))
                assert len(rows) == len(api)
                for row, plan in zip(rows, api):
                    assert int(row["rank"]) == plan["rank"] and row["placement"].split(CSV_LIST_SEPARATOR) == plan["placement"]
                    assert [int(n) for n in row["layers_per_stage"].split(CSV_LIST_SEPARATOR)] == plan["layers_per_stage"]
                    assert close(float(row["step_time_s"]), plan["step_time_s"])

    check(max_examples, derandomize, prop, specs(), st.sampled_from(sorted(SORT_KEYS)), st.sampled_from([None, 1, 3]),
          st.sampled_from([".json", ".csv"]),
          found=((DASHED_NODE_TYPE, "time", None, ".csv"), (INTERLEAVED_BEST, "cost", None, ".json")))


# -- recomputation ----------------------------------------------------------------------------------------------
def recompute_settings(plan: ExplicitPlan, block_layers: int) -> dict[str, dict]:
    """Every recompute mode and method on the plan: none, selective, full uniform, and full block with N = 1, 2,
    `block_layers` and the fewest layers a stage holds, where every stage holds N (as `fasop estimate` asks)."""
    settings = {"none": {}, "selective": {"recompute": "selective"},
                "uniform": {"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 1}}
    fewest = sum(plan.layers) if plan.pp == 1 else min(plan.layers)
    for n in sorted({1, 2, block_layers, fewest} & set(range(1, fewest + 1))):
        settings[f"block {n}"] = {"recompute": "full", "recompute_method": "block", "recompute_num_layers": n}
    return settings


def stage_chunks(plan: dict) -> list[list[tuple[int, dict]]]:
    """(layers, times) of each model chunk of each stage (a stage of a plain plan is one chunk)."""
    v = plan["virtual_stages"]
    layers = chunk_layers(np.array(plan["layers_per_stage"]), v).tolist()
    return [list(zip(counts, s["chunks"] if v > 1 else [s])) for counts, s in zip(layers, plan["stages"])]


def simulated_pipeline_s(plan: dict) -> float:
    """The plan's pipeline time by an event simulation of its stage (interleaved: chunk) times."""
    stages, m = plan["stages"], plan["num_microbatches"]
    send = [s["send_s"] for s in stages[:-1]]
    if plan["virtual_stages"] == 1:
        return simulate_1f1b([s["forward_s"] for s in stages], [s["compute_s"] - s["forward_s"] for s in stages],
                             send, m)
    return simulate_interleaved_1f1b([[c["forward_s"] for c in s["chunks"]] for s in stages],
                                     [[c["recompute_s"] + c["backward_s"] for c in s["chunks"]] for s in stages],
                                     send, plan["wrap_send_s"], m)


def check_recompute_times(plans: dict[str, dict], one_segment_per_stage: bool) -> None:
    """Recomputation adds only its forwards, each recomputed layer's once and in its own chunk: all of a chunk's
    layers under uniform recomputation, min(N, chunk layers) under block N, each layer's attention core under
    selective; a stage's recompute_s is the sum of its chunks'; the schedule times these chunks."""
    none, uniform = plans["none"], plans["uniform"]
    for name, plan in plans.items():
        assert math.isclose(plan["pipeline_time_s"], simulated_pipeline_s(plan), rel_tol=1e-9), name
        for i, (stage, plain) in enumerate(zip(plan["stages"], none["stages"])):
            assert math.isclose(stage["compute_s"] - plain["compute_s"], stage["recompute_s"], rel_tol=1e-9,
                                abs_tol=1e-15), (name, i)
            if plan["virtual_stages"] > 1:
                assert math.isclose(stage["recompute_s"], sum(c["recompute_s"] for c in stage["chunks"]),
                                    rel_tol=1e-12, abs_tol=1e-15), (name, i)
    pp, v = uniform["pp"], uniform["virtual_stages"]
    # the chunks holding the embedding, the head or an encoder-decoder model's decoder embedding
    ends = {(0, 0), (pp - 1, v - 1), (uniform["encoder_stages"], 0)}
    for i, chunks in enumerate(stage_chunks(uniform)):
        for j, (_, times) in enumerate(chunks):
            if (i, j) not in ends:  # every layer's forward again
                assert math.isclose(times["recompute_s"], times["forward_s"], rel_tol=1e-12, abs_tol=1e-15), (i, j)
        for name, plan in plans.items():
            redone = [times["recompute_s"] for _, times in stage_chunks(plan)[i]]
            assert all(r == 0 for r, (layers, _) in zip(redone, chunks) if not layers), (name, i)
            if not one_segment_per_stage:  # one stage holds the encoder and the decoder: two blocks
                continue
            whole = [times["recompute_s"] for _, times in chunks]
            if name.startswith("block"):
                n = plan["recompute_num_layers"]
                for (layers, _), r, w in zip(chunks, redone, whole):
                    assert math.isclose(r * layers, min(n, layers) * w, rel_tol=1e-12, abs_tol=1e-15), (name, i)
            if name == "selective":  # the same share of every layer's forward on one stage
                shares = [r / w for r, w in zip(redone, whole) if w > 0]
                assert all(math.isclose(share, shares[0], rel_tol=1e-9) for share in shares), (i, shares)


def check_recompute_memory(plans: dict[str, dict]) -> None:
    """Recomputation never adds memory: on every stage none >= selective >= full uniform, none >= full block N
    >= full uniform, and block recomputation of more layers holds no more."""
    def memory(name: str) -> np.ndarray:
        return np.array([s["memory_gib"] for s in plans[name]["stages"]])

    def no_more(a: str, b: str) -> None:
        assert (memory(a) <= memory(b) * (1 + 1e-12)).all(), (a, memory(a), b, memory(b))

    no_more("selective", "none")
    no_more("uniform", "selective")
    blocks = sorted((name for name in plans if name.startswith("block")), key=lambda name: int(name.split()[1]))
    for lighter, heavier in zip(["none", *blocks], [*blocks, "uniform"]):
        no_more(heavier, lighter)


@examples(ci=300, slow=3000)
def test_recomputation_frees_memory_and_times_each_recomputed_layer_once(max_examples, derandomize):
    def prop(drawn, block_layers):
        spec, plan = drawn
        with tempfile.TemporaryDirectory() as root:
            w = written(spec, root)
            plans = {name: estimate(w.model, w.cluster, tp=plan.tp, dp=plan.dp, pp=plan.pp, mbs=plan.mbs,
                                    placement=plan.placement, layers_per_stage=plan.layers, profiles_dir=str(w.profiles),
                                    virtual_stages=plan.virtual_stages, **setting).record()
                     for name, setting in recompute_settings(plan, block_layers).items()}
        check_recompute_memory(plans)
        check_recompute_times(plans, plan.pp > 1 or not w.model.is_encoder_decoder)

    check(max_examples, derandomize, prop, explicit_plans(), st.integers(1, 6))
