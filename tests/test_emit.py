"""fasop emit: the Slurm and Megatron-LM scripts written for a plan, and the command's errors."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner
from conftest import llama_toml, one_line_error

from fasop.cli import main
from fasop.cli.emit import emit
from fasop.errors import InputError
from fasop.inputs.cluster import load_cluster
from fasop.inputs.model import load_model
from fasop.launch.megatron import fasop_units_to_layers, first_last_split, pipeline_layout
from fasop.launch.options import LaunchOptions, launch_options
from fasop.launch.write import emit_plan, render_plan
from fasop.plans import Plan, load_plans
from fasop.search import estimate

CLUSTER_TOML = """\
[cluster]
name = "mixed"

[[node_type]]
name = "big"
gpu = "H100"
gpus_per_node = 2
gpu_memory_gib = 79.0
intra_node_bandwidth = "900 GB/s"
inter_node_bandwidth = "400 Gbit/s"
price_per_hour_usd = 12.0
count = 2
gres_type = "big"

[[node_type]]
name = "small"
gpu = "A10G"
gpus_per_node = 2
gpu_memory_gib = 22.0
intra_node_bandwidth = "64 GB/s"
inter_node_bandwidth = "50 Gbit/s"
price_per_hour_usd = 2.0
count = 2
gres_type = "small"
"""

LLAMA_TOML = llama_toml(name="tiny-llama", num_layers=8, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                        ffn_hidden_size=1376, global_batch_size=32)


SMOKE = LaunchOptions(smoke_test=True)  # a short run on mock data: the plan's split, shape and site options alone


def write_cluster(directory: Path, launch: str = "") -> Path:
    path = directory / "mixed.toml"
    path.write_text(CLUSTER_TOML + (f"\n[launch]\n{launch}" if launch else ""))
    return path


def make_plan(cluster_file: str = "mixed.toml", **changes) -> dict:
    """A plausible plan for gpt2-xl on 2 big and 2 small nodes of 2 GPUs, not starting with the fast type."""
    plan = {
        "rank": 1, "model": "gpt2-xl", "model_file": "gpt2-xl", "cluster": "mixed", "cluster_file": cluster_file,
        "gbs": 64, "mbs": 2, "tp": 1, "dp": 2, "pp": 4, "num_microbatches": 16,
        "placement": ["small", "big", "big", "small"], "layers_per_stage": [10, 13, 14, 11],
        "encoder_stages": 0, "distributed_optimizer": False,
        "step_time_s": 1.25, "throughput_samples_per_s": 51.2, "peak_memory_gib": 18.5,
    }
    plan.update(changes)
    return plan


def launchable(**changes) -> Plan:
    """make_plan(**changes) read as a plan file's entry is."""
    return Plan.model_validate(make_plan(**changes))


def fresh_plan(directory: Path, **changes) -> dict:
    """make_plan(**changes) with the figures `fasop estimate` gives it on the cluster file in `directory`."""
    plan = make_plan(**changes)
    row = estimate(load_model(plan["model_file"]), load_cluster(str(directory / plan["cluster_file"])),
                   tp=plan["tp"], dp=plan["dp"], pp=plan["pp"], mbs=plan["mbs"], placement=plan["placement"],
                   layers_per_stage=plan["layers_per_stage"], gbs=plan["gbs"],
                   distributed_optimizer=plan["distributed_optimizer"]).record()
    assert row.pop("fits_memory")
    return {**plan, **row, "cluster_file": plan["cluster_file"]}  # the file as named beside the plan list


@pytest.fixture
def cluster(tmp_path):
    return load_cluster(str(write_cluster(tmp_path)))


@pytest.fixture
def gpt2():
    return load_model("gpt2-xl")


def megatron_args(run_inter: str) -> list[str]:
    """The arguments run_inter.sh hands to the entry script, read from its bash arrays."""
    args: list[str] = []
    names = ("PARALLEL_ARGS", "MODEL_ARGS", "TRAINING_ARGS", "DATA_ARGS", "EXTRA_ARGS")
    current = None
    for line in run_inter.splitlines():
        if line.endswith("=(") and line[:-2] in names:
            current = line[:-2]
        elif line == ")":
            current = None
        elif current:
            args += shlex.split(line)
    return args


def flag_values(args: list[str]) -> dict[str, list[str]]:
    """{"--flag": [values...]} in order of appearance (flags without values map to [])."""
    result: dict[str, list[str]] = {}
    flag = None
    for arg in args:
        if arg.startswith("--"):
            flag = arg
            result[flag] = []
        else:
            result[flag].append(arg)
    return result


def sbatch_components(sbatch: str) -> list[list[str]]:
    """The #SBATCH lines of each heterogeneous-job component."""
    components: list[list[str]] = [[]]
    for line in sbatch.splitlines():
        if line == "#SBATCH hetjob":
            components.append([])
        elif line.startswith("#SBATCH "):
            components[-1].append(line[len("#SBATCH "):])
    return components


# -- the layer split --------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers, expected", [
    ([13, 5, 5, 1], "Et*13|t*5|t*5|t,L"),
    ([10, 13, 14, 11], "Et*10|t*13|t*14|t*11,L"),
    ([0, 24, 24], "E|t*24|t*24,L"),
    ([47, 1], "Et*47|t,L"),
    ([24, 0], "Et*24|L"),
    ([48], "Et*48,L"),
])
def test_layout_string(layers, expected):
    assert pipeline_layout(layers) == expected


@pytest.mark.parametrize("layers, expected", [
    ([10, 13, 13, 12], (10, 12)),
    ([13, 12, 12, 11], (13, 11)),
    ([13, 12, 12, 12], (13, None)),
    ([12, 12, 12, 11], (None, 11)),
    ([20, 28], (20, 28)),
    ([12, 12, 12, 12], None),   # even: no flag at all
    ([10, 13, 14, 11], None),   # middle stages differ
    ([0, 16, 16, 16], None),    # Megatron needs >= 1 layer on a stage given by --decoder-first-...
    ([24, 0, 0, 24], None),
])
def test_first_last_form(layers, expected):
    assert first_last_split(layers) == expected


def split_flags_of(plan, model, cluster, **options) -> dict[str, list[str]]:
    files = render_plan(Plan.model_validate(plan), model, cluster, LaunchOptions(smoke_test=True, **options))
    flags = flag_values(megatron_args(files["run_inter.sh"]))
    keys = ("--pipeline-model-parallel-layout", "--decoder-first-pipeline-num-layers",
            "--decoder-last-pipeline-num-layers", "--balance", "--pipeline-model-parallel-split-rank")
    return {k: v for k, v in flags.items() if k in keys}


def test_even_split_needs_no_flag(gpt2, cluster):
    assert split_flags_of(make_plan(layers_per_stage=[12, 12, 12, 12]), gpt2, cluster) == {}


def test_first_last_form_when_it_fits(gpt2, cluster):
    plan = make_plan(layers_per_stage=[10, 13, 13, 12])
    assert split_flags_of(plan, gpt2, cluster) == {
        "--decoder-first-pipeline-num-layers": ["10"], "--decoder-last-pipeline-num-layers": ["12"]}
    plan = make_plan(layers_per_stage=[15, 11, 11, 11])
    assert split_flags_of(plan, gpt2, cluster) == {"--decoder-first-pipeline-num-layers": ["15"]}


def test_layout_when_the_older_form_does_not_fit(gpt2, cluster):
    plan = make_plan(layers_per_stage=[10, 13, 14, 11])
    assert split_flags_of(plan, gpt2, cluster) == {"--pipeline-model-parallel-layout": ["Et*10|t*13|t*14|t*11,L"]}


def test_layout_can_be_forced(gpt2, cluster):
    plan = make_plan(layers_per_stage=[10, 13, 13, 12])
    assert split_flags_of(plan, gpt2, cluster, pipeline_split="layout") == {
        "--pipeline-model-parallel-layout": ["Et*10|t*13|t*13|t*12,L"]}


def test_first_last_forced_on_a_split_without_that_form_is_refused(gpt2, cluster):
    with pytest.raises(InputError, match="does not have that form"):
        render_plan(launchable(), gpt2, cluster, LaunchOptions(smoke_test=True, pipeline_split="first-last"))


def test_fasop_units_to_layers():
    # Reference section 5: [10,6,6,6,6,6,6,4] units -> 9-6-6-6-6-6-6-3 layers for GPT/BERT.
    assert fasop_units_to_layers([10, 6, 6, 6, 6, 6, 6, 4], "decoder") == [9, 6, 6, 6, 6, 6, 6, 3]
    assert fasop_units_to_layers([7, 6, 6, 6, 6, 6, 6, 7], "encoder") == [6] * 8
    # T5: the decoder-embedding unit sits in the first decoder stage, and there is no head unit.
    assert fasop_units_to_layers([12, 13, 12, 13], "encoder-decoder", encoder_stages=2) == [11, 13, 11, 13]
    assert fasop_units_to_layers([50], "encoder-decoder", encoder_stages=0) == [48]
    with pytest.raises(InputError):
        fasop_units_to_layers([0, 6], "decoder")


def test_fork_flavor_writes_balance(gpt2, cluster):
    layers = fasop_units_to_layers([11, 13, 15, 11], "decoder")
    assert layers == [10, 13, 15, 10]
    plan = launchable(layers_per_stage=layers)
    options = dict(megatron_flavor="fasop-fork", data_path="/data/gpt2_text_document",
                   vocab_file="/data/gpt2-vocab.json", merge_file="/data/gpt2-merges.txt")
    assert split_flags_of(plan, gpt2, cluster, **options) == {"--balance": ["10-13-15-10"]}
    args = flag_values(megatron_args(render_plan(plan, gpt2, cluster, LaunchOptions(smoke_test=True, **options))["run_inter.sh"]))
    assert "--mock-data" not in args and args["--tokenizer-type"] == ["GPT2BPETokenizer"]


def test_fork_flavor_for_t5_keeps_the_split_rank(cluster):
    t5 = load_model("t5")
    plan = make_plan(model="t5", model_file="t5", gbs=128, layers_per_stage=[11, 13, 11, 13], encoder_stages=2)
    options = dict(megatron_flavor="fasop-fork", data_path="/data/t5", vocab_file="/data/vocab.txt")
    assert split_flags_of(plan, t5, cluster, **options) == {
        "--balance": ["11-13-11-13"], "--pipeline-model-parallel-split-rank": ["2"]}


def test_fork_flavor_refuses_what_the_fork_cannot_run(gpt2, cluster, tmp_path):
    with pytest.raises(InputError, match="^megatron_flavor=fasop-fork: needs a data path"):
        render_plan(launchable(), gpt2, cluster, LaunchOptions(smoke_test=True, megatron_flavor="fasop-fork"))
    (tmp_path / "llama.toml").write_text(LLAMA_TOML)
    llama = load_model(str(tmp_path / "llama.toml"))
    plan = launchable(model="tiny-llama", gbs=32, layers_per_stage=[2, 2, 2, 2])
    with pytest.raises(InputError, match="--swiglu"):
        render_plan(plan, llama, cluster, LaunchOptions(smoke_test=True, megatron_flavor="fasop-fork", data_path="d",
                                                        vocab_file="v"))


def test_encoder_decoder_even_split_uses_the_split_rank(cluster):
    t5 = load_model("t5")
    plan = make_plan(model="t5", model_file="t5", gbs=128, layers_per_stage=[12, 12, 12, 12], encoder_stages=2)
    files = render_plan(Plan.model_validate(plan), t5, cluster, SMOKE)
    args = flag_values(megatron_args(files["run_inter.sh"]))
    assert args["--pipeline-model-parallel-split-rank"] == ["2"]
    assert args["--encoder-num-layers"] == ["24"] and args["--decoder-num-layers"] == ["24"]
    assert args["--encoder-seq-length"] == ["512"] and args["--decoder-seq-length"] == ["512"]
    assert "--num-layers" not in args and "--pipeline-model-parallel-layout" not in args
    assert files["run_inter.sh"].count("pretrain_t5.py") == 1


def test_encoder_decoder_uneven_split_is_refused_with_the_reason(cluster):
    t5 = load_model("t5")
    plan = make_plan(model="t5", model_file="t5", gbs=128, layers_per_stage=[10, 14, 12, 12], encoder_stages=2)
    with pytest.raises(InputError) as err:
        render_plan(Plan.model_validate(plan), t5, cluster, SMOKE)
    message = str(err.value)
    assert "\n" not in message and "split-rank" in message and "evenly" in message


# -- Megatron-LM flags ------------------------------------------------------------------------------------


def test_stock_flags_for_gpt2(gpt2, cluster):
    files = render_plan(launchable(tp=2, dp=1, gbs=64, distributed_optimizer=True), gpt2, cluster, SMOKE)
    args = flag_values(megatron_args(files["run_inter.sh"]))
    assert args["--tensor-model-parallel-size"] == ["2"]
    assert args["--pipeline-model-parallel-size"] == ["4"]
    assert args["--micro-batch-size"] == ["2"] and args["--global-batch-size"] == ["64"]
    assert args["--num-layers"] == ["48"] and args["--hidden-size"] == ["1600"]
    assert args["--num-attention-heads"] == ["16"] and args["--kv-channels"] == ["100"]
    assert args["--ffn-hidden-size"] == ["6400"] and args["--seq-length"] == ["1024"]
    assert args["--max-position-embeddings"] == ["1024"]
    assert "--fp16" in args and "--sequence-parallel" in args and "--use-distributed-optimizer" in args
    for absent in ("--swiglu", "--group-query-attention", "--normalization", "--bf16",
                   "--untie-embeddings-and-output-weights", "--position-embedding-type", "--disable-bias-linear"):
        assert absent not in args
    assert args["--mock-data"] == [] and args["--tokenizer-type"] == ["NullTokenizer"]
    assert args["--vocab-size"] == ["50256"]  # NullTokenizer adds the end-of-document id: 50257 in all
    assert "pretrain_gpt.py" in files["run_inter.sh"]


def test_no_sequence_parallel_or_distributed_optimizer_unless_the_plan_says(gpt2, cluster):
    args = flag_values(megatron_args(render_plan(launchable(), gpt2, cluster, SMOKE)["run_inter.sh"]))
    assert "--sequence-parallel" not in args and "--use-distributed-optimizer" not in args


def test_model_shape_flags_follow_the_model(cluster, tmp_path):
    (tmp_path / "llama.toml").write_text(LLAMA_TOML)
    llama = load_model(str(tmp_path / "llama.toml"))
    plan = make_plan(model="tiny-llama", gbs=32, layers_per_stage=[2, 2, 2, 2])
    args = flag_values(megatron_args(render_plan(Plan.model_validate(plan), llama, cluster, SMOKE)["run_inter.sh"]))
    assert args["--group-query-attention"] == [] and args["--num-query-groups"] == ["2"]
    assert args["--swiglu"] == [] and args["--normalization"] == ["RMSNorm"]
    assert args["--position-embedding-type"] == ["rope"]
    assert "--untie-embeddings-and-output-weights" in args and "--disable-bias-linear" in args
    assert args["--attention-dropout"] == ["0"] and args["--hidden-dropout"] == ["0"]
    assert "--bf16" in args and "--fp16" not in args


def test_bert_uses_its_entry_script_and_wordpiece(cluster):
    bert = load_model("bert")
    plan = launchable(model="bert", model_file="bert", gbs=256, layers_per_stage=[6, 6, 6, 6])
    files = render_plan(plan, bert, cluster, LaunchOptions(smoke_test=True, vocab_file="/data/bert-vocab.txt", data_path="/d/b"))
    args = flag_values(megatron_args(files["run_inter.sh"]))
    assert "pretrain_bert.py" in files["run_inter.sh"]
    assert args["--tokenizer-type"] == ["BertWordPieceLowerCase"] and args["--data-path"] == ["/d/b"]
    assert args["--seq-length"] == ["512"]


def test_extra_flags_come_last(gpt2, cluster):
    options = launch_options({"extra_flags": ["--log-interval", "1"]}, extra_flags=("--save", "/ckpt dir"),
                             smoke_test=True)
    args = megatron_args(render_plan(launchable(), gpt2, cluster, options)["run_inter.sh"])
    assert args[-4:] == ["--log-interval", "1", "--save", "/ckpt dir"]


# -- the Slurm job ----------------------------------------------------------------------------------------


def test_hetjob_components_follow_the_placement(gpt2, cluster):
    sbatch = render_plan(launchable(), gpt2, cluster, SMOKE)["sbatch.sh"]
    components = sbatch_components(sbatch)
    assert len(components) == 3
    for lines, (gres, nodes) in zip(components, [("small", 1), ("big", 2), ("small", 1)]):
        assert f"--gres=gpu:{gres}:2" in lines
        assert f"--nodes={nodes}" in lines
        assert "--ntasks-per-node=1" in lines
    assert "--output=fasop-%j.out" in components[0] and "--error=fasop-%j.err" in components[0]
    assert not any(line.startswith(("--output", "--error")) for c in components[1:] for line in c)
    assert 'srun "${SRUN_ARGS[@]}" bash "$RUN_DIR/run_inter.sh"' in sbatch
    assert "SRUN_ARGS=(--het-group=0-2 --kill-on-bad-exit=1)" in sbatch
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | sed -n 1p' in sbatch
    # No hard-coded address: MASTER_ADDR is only ever computed from the allocation.
    assert [line for line in sbatch.splitlines() if "MASTER_ADDR=" in line] == [
        'MASTER_ADDR="$(scontrol -o show node "$MASTER_NODE" 2>/dev/null | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\' || true)"',
        'export MASTER_ADDR="${MASTER_ADDR:-$MASTER_NODE}"']


def test_single_type_placement_is_one_plain_job(gpt2, cluster):
    plan = make_plan(placement=["big", "big"], tp=2, dp=1, pp=2, layers_per_stage=[23, 25])
    sbatch = render_plan(Plan.model_validate(plan), gpt2, cluster, SMOKE)["sbatch.sh"]
    components = sbatch_components(sbatch)
    assert len(components) == 1
    assert "--nodes=2" in components[0] and "--gres=gpu:big:2" in components[0]
    assert "--het-group" not in sbatch
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p' in sbatch


def test_partitions_and_gres_from_options_and_cluster(gpt2, tmp_path):
    cluster = load_cluster(str(write_cluster(tmp_path, 'partition = { big = "hgx" }\ngres_type = { A10G = "a10g" }\n'
                                                       'account = "proj"\ntime_limit = "2-00:00:00"\n')))
    options = launch_options(cluster.launch, "mixed.toml: launch", cpus_per_task=8, smoke_test=True)
    components = sbatch_components(render_plan(launchable(), gpt2, cluster, options)["sbatch.sh"])
    assert "--partition=hgx" in components[1] and not any(line.startswith("--partition") for line in components[0])
    assert "--gres=gpu:a10g:2" in components[0] and "--gres=gpu:big:2" in components[1]
    assert all("--account=proj" in c and "--time=2-00:00:00" in c and "--cpus-per-task=8" in c for c in components)


def test_untyped_gres_on_request(gpt2, cluster):
    options = launch_options({"gres_type": ""}, "c.toml: launch", gres_types={"small": "a10g"}, smoke_test=True)
    components = sbatch_components(render_plan(launchable(), gpt2, cluster, options)["sbatch.sh"])
    assert "--gres=gpu:a10g:2" in components[0] and "--gres=gpu:big:2" in components[1]  # the cluster says big
    options = launch_options({}, gres_types={"big": "", "small": ""}, smoke_test=True)
    components = sbatch_components(render_plan(launchable(), gpt2, cluster, options)["sbatch.sh"])
    assert all("--gres=gpu:2" in c for c in components)


def test_gpus_per_node_override_must_match_the_plan(gpt2, cluster):
    with pytest.raises(InputError, match="the placement.s 4 nodes of 4 GPUs hold 16"):
        render_plan(launchable(), gpt2, cluster, LaunchOptions(smoke_test=True, gpus_per_node=4))


def test_plan_and_model_must_agree(gpt2, cluster):
    with pytest.raises(InputError, match="summing to 48 layers, got 10,13,13,11"):
        render_plan(launchable(layers_per_stage=[10, 13, 13, 11]), gpt2, cluster, SMOKE)
    with pytest.raises(InputError, match="not in cluster"):
        render_plan(launchable(placement=["small", "huge", "big", "small"]), gpt2, cluster, SMOKE)
    with pytest.raises(InputError, match="uses 3 nodes of type big"):
        render_plan(launchable(placement=["big", "big", "big", "small"]), gpt2, cluster, SMOKE)


def test_container_image(gpt2, cluster):
    options = LaunchOptions(smoke_test=True, container_image="nvcr.io#nvidia/pytorch:24.05-py3", container_mounts="/data:/data")
    sbatch = render_plan(launchable(), gpt2, cluster, options)["sbatch.sh"]
    assert "CONTAINER_IMAGE='nvcr.io#nvidia/pytorch:24.05-py3'" in sbatch
    assert 'CONTAINER_MOUNTS="$RUN_DIR:$RUN_DIR",/data:/data' in sbatch
    assert '--container-image="$CONTAINER_IMAGE"' in sbatch


def test_launch_table_errors():
    with pytest.raises(InputError, match=r"c.toml: launch.partitoin: unknown key"):
        launch_options({"partitoin": "gpu"}, "c.toml: launch")
    with pytest.raises(InputError, match=r"launch.time_limit"):
        launch_options({"time_limit": "one hour"}, "c.toml: launch")
    with pytest.raises(InputError, match=r"launch.megatron_flavor"):
        launch_options({"megatron_flavor": "nemo"}, "c.toml: launch")
    with pytest.raises(InputError, match=r"^master_port: expected a port number"):
        launch_options({}, master_port=70000)


# -- determinism and writing ------------------------------------------------------------------------------


def test_output_is_deterministic(gpt2, cluster, tmp_path):
    first = emit_plan(launchable(), gpt2, cluster, tmp_path / "a", SMOKE)
    second = emit_plan(launchable(), gpt2, cluster, tmp_path / "b", SMOKE)
    assert [p.name for p in first] == ["sbatch.sh", "run_inter.sh", "plan.json"]
    for a, b in zip(first, second):
        assert a.read_bytes() == b.read_bytes()
    assert os.access(first[0], os.X_OK) and os.access(first[1], os.X_OK)
    assert json.loads(first[2].read_text()) == make_plan()
    assert first[2].read_text() == json.dumps(make_plan(), indent=2, sort_keys=True) + "\n"


def test_existing_files_are_kept_unless_forced(gpt2, cluster, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(InputError, match="holds files already"):
        emit_plan(launchable(), gpt2, cluster, out, SMOKE)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    emit_plan(launchable(), gpt2, cluster, out, SMOKE, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "plan.json", "run_inter.sh", "sbatch.sh"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.toml", "out"]  # no temporary left


def test_a_failed_write_leaves_nothing(gpt2, cluster, tmp_path, monkeypatch):
    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "rename", fail)
    with pytest.raises(InputError, match="cannot write"):
        emit_plan(launchable(), gpt2, cluster, tmp_path / "out", SMOKE)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixed.toml"]


def test_a_refused_plan_writes_nothing(gpt2, cluster, tmp_path):
    with pytest.raises(InputError):
        emit_plan(launchable(layers_per_stage=[1, 1, 1, 1]), gpt2, cluster, tmp_path / "out", SMOKE)
    assert not (tmp_path / "out").exists()


# -- the scripts as bash sees them ------------------------------------------------------------------------


def script_variants(tmp_path, gpt2, cluster):
    (tmp_path / "llama.toml").write_text(LLAMA_TOML)
    llama = load_model(str(tmp_path / "llama.toml"))
    yield render_plan(launchable(), gpt2, cluster, SMOKE)
    yield render_plan(launchable(placement=["big", "big"], tp=2, dp=1, pp=2, layers_per_stage=[23, 25]), gpt2, cluster, SMOKE)
    yield render_plan(launchable(model="tiny-llama", gbs=32, layers_per_stage=[2, 2, 2, 2], tp=2, dp=1), llama, cluster,
                      LaunchOptions(smoke_test=True, container_image="img with space.sqsh", container_mounts="/a b:/c",
                                    megatron_path="/opt/Mega tron's", extra_flags=("--save", "/x y", "--z"),
                                    cpus_per_task=4, account="a1", data_path="/data/$HOME/x"))
    yield render_plan(launchable(), gpt2, cluster, LaunchOptions(smoke_test=True, megatron_flavor="fasop-fork", data_path="/d",
                                                                vocab_file="/v", merge_file="/m",
                                                                entry_script="/abs/_00_pretrain_gpt.py"))


def test_scripts_pass_bash_n(tmp_path, gpt2, cluster):
    for index, files in enumerate(script_variants(tmp_path, gpt2, cluster)):
        for name in ("sbatch.sh", "run_inter.sh"):
            path = tmp_path / f"{index}-{name}"
            path.write_text(files[name])
            result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
            assert result.returncode == 0, result.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck(tmp_path, gpt2, cluster):
    for index, files in enumerate(script_variants(tmp_path, gpt2, cluster)):
        for name in ("sbatch.sh", "run_inter.sh"):
            path = tmp_path / f"{index}-{name}"
            path.write_text(files[name])
            result = subprocess.run(["shellcheck", "--severity=style", str(path)], capture_output=True, text=True)
            assert result.returncode == 0, result.stdout + result.stderr


def fake_torchrun(directory: Path) -> Path:
    """A torchrun stand-in that writes the arguments it received, one per line."""
    bin_dir = directory / "bin"
    bin_dir.mkdir()
    script = bin_dir / "torchrun"
    script.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$ARGS_OUT"\n')
    script.chmod(0o755)
    return bin_dir


def test_run_inter_hands_the_arguments_over_intact(tmp_path, gpt2, cluster):
    options = LaunchOptions(smoke_test=True, megatron_path="/opt/Mega tron", extra_flags=("--save", "/ckpt dir"))
    files = render_plan(launchable(), gpt2, cluster, options)
    script = tmp_path / "run_inter.sh"
    script.write_text(files["run_inter.sh"])
    env = {"PATH": f"{fake_torchrun(tmp_path)}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args"),
           "SLURM_PROCID": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "7001", "FASOP_GPU_NAME": "NVIDIA H100 80GB HBM3"}
    result = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "node rank 2 of 4 (plan: big)" in result.stdout
    argv = (tmp_path / "args").read_text().splitlines()
    assert argv[:10] == ["--nnodes", "4", "--nproc_per_node", "2", "--node_rank", "2",
                         "--master_addr", "10.1.2.3", "--master_port", "7001"]
    assert argv[10] == "/opt/Mega tron/pretrain_gpt.py"
    assert argv[11:] == megatron_args(files["run_inter.sh"])
    assert "Et*10|t*13|t*14|t*11,L" in argv and argv[-2:] == ["--save", "/ckpt dir"]


def test_run_inter_refuses_a_missing_or_bad_node_rank(tmp_path, gpt2, cluster):
    script = tmp_path / "run_inter.sh"
    script.write_text(render_plan(launchable(), gpt2, cluster, SMOKE)["run_inter.sh"])
    base = {"PATH": f"{fake_torchrun(tmp_path)}:{os.environ['PATH']}", "ARGS_OUT": str(tmp_path / "args"),
            "MASTER_ADDR": "h", "FASOP_GPU_NAME": "NVIDIA A10G"}
    for extra in ({}, {"NODE_RANK": "4"}, {"NODE_RANK": "x"}):
        result = subprocess.run(["bash", str(script)], env={**base, **extra}, capture_output=True, text=True)
        assert result.returncode == 1 and "node rank" in result.stderr
    result = subprocess.run(["bash", str(script)], env={**base, "NODE_RANK": "3"}, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# -- the command ------------------------------------------------------------------------------------------


def runner() -> CliRunner:
    try:
        return CliRunner(mix_stderr=False)
    except TypeError:  # click >= 8.2 keeps stderr apart always
        return CliRunner()


def write_plans(tmp_path: Path, plans) -> Path:
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(plans))
    return path


def test_cli_writes_the_files(tmp_path):
    write_cluster(tmp_path, 'partition = "gpu"\nmaster_port = 6123\n')
    plans = write_plans(tmp_path, [fresh_plan(tmp_path), fresh_plan(tmp_path, rank=2, layers_per_stage=[10, 14, 14, 10])])
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--rank", "2", "--out", str(tmp_path / "out"),
                                    "--partition", "small=cheap", "--extra-flags", "--log-interval 1"])
    assert result.exit_code == 0, result.stderr
    files = {p.name: p.read_text() for p in (tmp_path / "out").iterdir()}
    assert sorted(files) == ["plan.json", "run_inter.sh", "sbatch.sh"]
    assert json.loads(files["plan.json"])["rank"] == 2
    components = sbatch_components(files["sbatch.sh"])
    assert "--partition=cheap" in components[0] and "--partition=gpu" in components[1]
    assert 'MASTER_PORT="${MASTER_PORT:-6123}"' in files["sbatch.sh"]
    assert megatron_args(files["run_inter.sh"])[-2:] == ["--log-interval", "1"]


def test_cli_missing_plan_file(tmp_path):
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(tmp_path / "nope.json"), "--out", str(tmp_path / "o")])
    one_line_error(result, "nope.json", "no such plan file")


@pytest.mark.parametrize("content, fragment", [
    ("{not json", "not JSON"),
    ('{"rank": 1}', "expected a non-empty JSON list"),
    ("[]", "expected a non-empty JSON list"),
    ('[{"rank": 1, "tp": 1}]', "entry 0: gbs: missing"),
    ("[3]", "entry 0: not a fasop plan: expected a JSON object"),
])
def test_cli_not_a_plan_file(tmp_path, content, fragment):
    path = tmp_path / "plans.json"
    path.write_text(content)
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(path), "--out", str(tmp_path / "o")])
    one_line_error(result, "plans.json", fragment)


def test_cli_rank_beyond_the_list(tmp_path):
    plans = write_plans(tmp_path, [make_plan(), make_plan(rank=2)])
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--rank", "3", "--out", str(tmp_path / "o")])
    one_line_error(result, "--rank 3", "2 plans")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("missing, option", [("model_file", "--model"), ("cluster_file", "--cluster")])
def test_cli_a_plan_that_names_no_input_file_needs_the_option(tmp_path, missing, option):
    cluster = write_cluster(tmp_path)
    plan = fresh_plan(tmp_path)
    del plan[missing]
    plans = write_plans(tmp_path, [plan])
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--out", str(tmp_path / "o")])
    one_line_error(result, f"names no {missing}", f"give {option}")
    given = {"--model": "gpt2-xl", "--cluster": str(cluster)}[option]
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--out", str(tmp_path / "o"), option, given])
    assert result.exit_code == 0, result.stderr


def test_cli_output_directory_with_files(tmp_path):
    write_cluster(tmp_path)
    plans = write_plans(tmp_path, [fresh_plan(tmp_path)])
    out = tmp_path / "o"
    out.mkdir()
    (out / "old.txt").write_text("x")
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--out", str(out)])
    one_line_error(result, "--force")
    assert [p.name for p in out.iterdir()] == ["old.txt"]
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--out", str(out), "--force"])
    assert result.exit_code == 0, result.stderr


def test_cli_refused_plan_is_one_line(tmp_path):
    write_cluster(tmp_path)
    plans = write_plans(tmp_path, [fresh_plan(tmp_path, layers_per_stage=[10, 13, 14, 11])])
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--out", str(tmp_path / "o"),
                                    "--pipeline-split", "first-last"])
    one_line_error(result, "first-last")
    result = runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--out", str(tmp_path / "o"), "--time-limit", "soon"])
    one_line_error(result, "--time-limit")


def test_every_option_has_help():
    for param in emit.params:
        if isinstance(param, click.Option):
            assert param.help, param.name
    assert "Usage" in runner().invoke(emit, ["--help"]).output


def test_load_plans_reads_what_it_checks(tmp_path):
    plans = write_plans(tmp_path, [make_plan()])
    assert [plan.record() for plan in load_plans(plans)] == [make_plan()]
    with pytest.raises(InputError, match="JSON plan list"):
        load_plans(tmp_path / "plans.csv")


def test_the_documented_launch_table_is_valid():
    import re
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    text = (Path(__file__).resolve().parents[1] / "docs" / "formats.md").read_text()
    block = re.search(r"```toml\n(\[launch\]\n.*?)```", text, re.S).group(1)
    table = tomllib.loads(block)["launch"]
    options = launch_options(table, "docs: launch")
    assert options.partitions == {"A100": "hgx", "A10": "gpu2"} and options.extra_flags == ("--log-interval", "1")


# -- the plan estimated afresh ------------------------------------------------------------------------------


@pytest.fixture
def searched(tmp_path):
    """A plan list written by `fasop search --output` for gpt2-xl on the mixed cluster."""
    write_cluster(tmp_path)
    result = runner().invoke(main, ["search", "--model", "gpt2-xl", "--cluster", str(tmp_path / "mixed.toml"),
                                    "--gbs", "64", "--train-steps", "1000", "--output", str(tmp_path / "plans.json")])
    assert result.exit_code == 0, result.stderr
    return tmp_path / "plans.json"


def emit_rank(plans: Path, rank: int, out: Path, *options: str):
    return runner().invoke(emit, ["--smoke-test", "--plans", str(plans), "--rank", str(rank), "--out", str(out), *options])


def test_an_untouched_plan_from_search_is_emitted_as_it_is(searched):
    plans = json.loads(searched.read_text())
    for rank in (1, 2, len(plans)):
        out = searched.parent / f"out{rank}"
        result = emit_rank(searched, rank, out)
        assert result.exit_code == 0, result.stderr
        assert "warning" not in result.stderr
        assert json.loads((out / "plan.json").read_text()) == plans[rank - 1]


def edit(plans_file: Path, change, index: int = 0) -> dict:
    """Apply `change` to plan `index` (default plan 1) of the list in place; returns the plan as it was."""
    plans = json.loads(plans_file.read_text())
    before = json.loads(json.dumps(plans[index]))
    change(plans[index])
    plans_file.write_text(json.dumps(plans))
    return before


def _move_a_layer(plan):
    plan["layers_per_stage"][0] += 1  # the figures and the per-stage breakdown still say the old split
    plan["layers_per_stage"][-1] -= 1


@pytest.mark.parametrize("change, fragment", [
    (lambda plan: plan.update(step_time_s=plan["step_time_s"] * 0.8), "step_time_s is"),
    (lambda plan: plan.update(peak_memory_gib=plan["peak_memory_gib"] / 2), "peak_memory_gib is"),
    (lambda plan: plan["stages"][-1].update(memory_gib=1.0), "stages[3].memory_gib is"),
    (lambda plan: plan.update(train_hours=1.0), "train_hours is"),
    (lambda plan: plan.update(num_microbatches=plan["num_microbatches"] + 1), "num_microbatches is"),
    (_move_a_layer, "estimated afresh"),
])
def test_a_hand_edited_plan_is_refused(searched, change, fragment):
    plans = json.loads(searched.read_text())
    # not interleaved: moving a layer of an interleaved plan breaks its chunk split, a refusal of its own
    index = next(i for i, plan in enumerate(plans)
                 if plan["pp"] == 4 and plan["layers_per_stage"][-1] > 1 and (plan["virtual_stages"] or 1) == 1)
    edit(searched, change, index)
    rank = plans[index]["rank"]
    result = emit_rank(searched, rank, searched.parent / "out")
    one_line_error(result, f"plan {rank}", "stale plan", fragment, "--force")
    assert not (searched.parent / "out").exists()


def test_force_emits_a_stale_plan_with_the_fresh_figures_and_a_warning(searched):
    before = edit(searched, lambda plan: plan.update(step_time_s=0.001, cost_per_step_usd=0.0))
    out = searched.parent / "out"
    result = emit_rank(searched, 1, out, "--force")
    assert result.exit_code == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "step_time_s is 0.001" in warnings[0] and "(forced)" in warnings[0]
    written = json.loads((out / "plan.json").read_text())
    assert written["step_time_s"] == pytest.approx(before["step_time_s"], rel=1e-9)
    assert written["cost_per_step_usd"] == pytest.approx(before["cost_per_step_usd"], rel=1e-9)


def test_a_plan_that_no_longer_fits_memory_is_refused(searched):
    plans = json.loads(searched.read_text())
    need = plans[0]["peak_memory_gib"]
    cluster = searched.parent / "mixed.toml"
    cluster.write_text(cluster.read_text().replace("gpu_memory_gib = 79.0", f"gpu_memory_gib = {need * 0.9:.3f}")
                                          .replace("gpu_memory_gib = 22.0", f"gpu_memory_gib = {need * 0.9:.3f}"))
    result = emit_rank(searched, 1, searched.parent / "out")
    one_line_error(result, "stale plan", "no longer fits memory")
    result = emit_rank(searched, 1, searched.parent / "out", "--force")
    assert result.exit_code == 0 and "no longer fits memory" in result.stderr


def test_a_plan_with_figures_missing_gets_them_from_the_estimate(tmp_path):
    write_cluster(tmp_path)
    bare = {key: make_plan()[key] for key in ("rank", "model_file", "cluster_file", "gbs", "mbs", "tp", "dp", "pp",
                                              "placement", "layers_per_stage", "distributed_optimizer")}
    plans = write_plans(tmp_path, [bare])
    result = emit_rank(plans, 1, tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    written = json.loads((tmp_path / "out" / "plan.json").read_text())
    figures = {k: v for k, v in fresh_plan(tmp_path).items() if k not in ("model", "cluster", "placement_search")}
    assert written == {**figures, **bare}
