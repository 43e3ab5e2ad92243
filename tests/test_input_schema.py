"""The schemas of the TOML inputs (model, cluster, GPU catalogue): unknown keys and values of the wrong TOML type
are refused, and the one line of every refusal names the file, the field's path and what was expected."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY_CLUSTER, TINY_NODE_TYPES, cluster_toml, model_toml, toml_table

from fasop.cli import main
from fasop.errors import InputError
from fasop.inputs.catalogue import GpuTable, load_gpu_specs
from fasop.inputs.cluster import ClusterHead, DeratingTable, NodeTypeTable, load_cluster
from fasop.inputs.model import ModelTable, load_model

MY_GPU = {"name": "MyGPU", "dense_fp16_tflops": 100.0, "dense_bf16_tflops": 100.0, "memory_gib": 24.0,
          "memory_bandwidth_gb_per_s": 1000.0, "intra_node_link": "25 GB/s", "matmul_efficiency": 0.5}


def gpu_toml(**changes) -> str:
    return toml_table("[[gpu]]", {**MY_GPU, **changes})


# Each table kind: how to write a file whose table has `field = value`, the loader, and the table's path.
def _model(tmp: Path, field: str, value) -> Path:
    path = tmp / "model.toml"
    path.write_text(model_toml({field: value}))
    return path


def _cluster_head(tmp: Path, field: str, value) -> Path:
    path = tmp / "cluster.toml"
    path.write_text(cluster_toml({field: value}))
    return path


def _derating(tmp: Path, field: str, value) -> Path:
    return _cluster_head(tmp, "derating", {field: value})


def _node_type(tmp: Path, field: str, value) -> Path:
    path = tmp / "cluster.toml"
    path.write_text(cluster_toml(node_overrides={"fast": {field: value}}))
    return path


def _cluster_gpu(tmp: Path, field: str, value) -> Path:
    path = tmp / "cluster.toml"
    path.write_text(cluster_toml(extra="\n" + gpu_toml(**{field: value})))
    return path


def _catalogue_gpu(tmp: Path, field: str, value) -> Path:
    path = tmp / "gpus.toml"
    path.write_text(gpu_toml(**{field: value}))
    return path


KINDS = {  # kind: (writer, loader, path of the table, path of the table where its name is broken, schema)
    "model": (_model, load_model, "model", "model", ModelTable),
    "cluster": (_cluster_head, load_cluster, "cluster", "cluster", ClusterHead),
    "derating": (_derating, load_cluster, "cluster.derating", "cluster.derating", DeratingTable),
    "node_type": (_node_type, load_cluster, "node_type.fast", "node_type[0]", NodeTypeTable),
    "cluster-gpu": (_cluster_gpu, load_cluster, "gpu.MyGPU", "gpu[0]", GpuTable),
    "catalogue-gpu": (_catalogue_gpu, load_gpu_specs, "gpu.MyGPU", "gpu[0]", GpuTable),
}
EVERY_FIELD = [pytest.param(kind, field, id=f"{kind}.{field}")
               for kind, (*_, schema) in KINDS.items() for field in schema.model_fields]


def refusal(tmp: Path, kind: str, field: str, value) -> tuple[Path, str]:
    write, load, *_ = KINDS[kind]
    path = write(tmp, field, value)
    with pytest.raises(InputError) as caught:
        load(str(path))
    return path, str(caught.value)


@pytest.mark.parametrize("kind, field", EVERY_FIELD)
def test_the_error_of_every_field_names_the_file_the_field_path_and_what_was_expected(tmp_path, kind, field):
    _, _, table, broken_name_table, _ = KINDS[kind]
    where = broken_name_table if field == "name" else table
    path, message = refusal(tmp_path, kind, field, [[1]])  # a TOML array of arrays: no field takes one
    assert message.startswith(f"{path}: {where}.{field}: expected "), message
    assert message.endswith(", got [[1]]") and "\n" not in message


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_keys_are_refused_in_every_table(tmp_path, kind):
    _, _, table, _, schema = KINDS[kind]
    path, message = refusal(tmp_path, kind, "colour", "green")
    assert message == f"{path}: {table}.colour: unknown field (known: {', '.join(sorted(schema.model_fields))})"


def test_a_misspelt_field_is_reported_as_unknown_rather_than_the_field_as_missing(tmp_path):
    path = tmp_path / "model.toml"
    path.write_text(model_toml({"hidden_size": None, "hiden_size": 64}))
    with pytest.raises(InputError, match=rf"^{path}: model\.hiden_size: unknown field \(known: "):
        load_model(str(path))


@pytest.mark.parametrize("file, text, known", [
    ("model.toml", model_toml() + "\n[optimizer]\nsteps = 3\n", "model, training"),
    ("cluster.toml", cluster_toml(extra="\n[network]\nspeed = 3\n"), "cluster, gpu, launch, node_type"),
    ("gpus.toml", gpu_toml() + "\n[vendor]\nname = 'x'\n", "gpu"),
])
def test_unknown_tables_are_refused_in_every_file_kind(tmp_path, file, text, known):
    path = tmp_path / file
    path.write_text(text)
    load = {"model.toml": load_model, "cluster.toml": load_cluster, "gpus.toml": load_gpu_specs}
    with pytest.raises(InputError) as caught:
        load[file](str(path))
    table = text.rsplit("[", 1)[1].split("]")[0]
    assert str(caught.value) == f"{path}: {table}: unknown table (known: {known})"


WRONG_TYPES = [  # kind, field, value, what the line says was expected, how it shows the value
    ("model", "num_layers", "4", "an integer from 1 to 1,024", "'4'"),
    ("model", "num_layers", 4.0, "an integer from 1 to 1,024", "4.0"),
    ("model", "num_layers", True, "an integer from 1 to 1,024", "true"),
    ("model", "tie_embeddings", 1, "true or false", "1"),
    ("model", "tie_embeddings", "true", "true or false", "'true'"),
    ("node_type", "count", "1", "an integer from 0 to 1,000,000", "'1'"),
    ("node_type", "gpus_per_node", 2.0, "an integer from 1 to 1,024", "2.0"),
    ("node_type", "gpus_per_node", False, "an integer from 1 to 1,024", "false"),
    ("node_type", "price_per_hour_usd", True, "a number >= 0 and <= 1e+06", "true"),
    ("node_type", "gpu_memory_gib", "16", "a number > 0 and <= 65536", "'16'"),
    ("node_type", "price_date", 5, "a non-empty string", "5"),
    ("cluster", "memory_margin", False, "a number >= 1 and <= 100", "false"),
    ("derating", "p2p_inter_node", True, "a number > 0 and <= 1000", "true"),
    ("cluster-gpu", "memory_gib", True, "a number > 0 and <= 1024", "true"),
    ("catalogue-gpu", "matmul_efficiency", "0.5", "a number >= 0.01 and <= 1", "'0.5'"),
]


@pytest.mark.parametrize("kind, field, value, expected, shown", WRONG_TYPES,
                         ids=[f"{k}.{f}={v!r}" for k, f, v, *_ in WRONG_TYPES])
def test_a_value_of_the_wrong_toml_type_is_refused_with_one_line(runner, tiny, tmp_path, kind, field, value,
                                                                 expected, shown):
    files = tiny()
    path = KINDS[kind][0](tmp_path, field, value)
    if kind == "catalogue-gpu":
        args = ["profile", "synth", "--model", str(files.model), "--gpu", "MyGPU", "--catalogue", str(path),
                "--tp", "1", "--mbs", "1", "--out", str(tmp_path / "out.csv")]
    else:
        option = "--model" if kind == "model" else "--cluster"
        args = ["search", *files.args(option, str(path)), "--output", str(tmp_path / "plans.json")]
    result = runner.invoke(main, args)
    assert result.exit_code == 2, result.output
    where = KINDS[kind][2]
    assert result.stderr == f"Error: {path}: {where}.{field}: expected {expected}, got {shown}\n"
    assert not list(tmp_path.glob("plans.json*")) and not (tmp_path / "out.csv").exists()


@pytest.mark.parametrize("architecture, field", [("decoder", "encoder_num_layers"), ("encoder", "decoder_seq_length"),
                                                 ("encoder-decoder", "num_layers")])
def test_a_layer_or_length_field_of_another_architecture_is_refused(tmp_path, architecture, field):
    split = {"encoder_num_layers": 2, "decoder_num_layers": 2, "encoder_seq_length": 32, "decoder_seq_length": 32,
             "num_layers": None, "seq_length": None}
    overrides = {**(split if architecture == "encoder-decoder" else {}), "architecture": architecture, field: 4}
    path = tmp_path / "model.toml"
    path.write_text(model_toml(overrides))
    with pytest.raises(InputError, match=rf"^{path}: model\.{field}: {architecture} models give "):
        load_model(str(path))


def test_the_tables_of_the_files_read_back_as_written(tmp_path):
    """Every value reaches the loaded objects, floats as floats (an integer price reads as 4.0)."""
    path = tmp_path / "cluster.toml"
    path.write_text(cluster_toml({"derating": {"p2p_inter_node": 2}}, {"fast": {"price_per_hour_usd": 4}},
                                 extra="\n" + gpu_toml()))
    cluster = load_cluster(str(path))
    fast = cluster.node_types["fast"]
    assert fast.price_per_hour_usd == 4.0 and isinstance(fast.price_per_hour_usd, float)
    assert fast.inter_node_bytes_per_s == 100e9 / 8 and fast.gpu_memory_gib == 16.0
    assert fast.instance == TINY_NODE_TYPES["fast"]["instance"] and fast.slurm_partition is None
    assert cluster.derating.p2p_inter_node == 2.0 and cluster.derating.p2p_intra_node == 1.0
    assert cluster.memory_margin == TINY_CLUSTER["memory_margin"] and cluster.launch == {}
    assert cluster.gpus["MyGPU"].link_bytes_per_s == 25e9 and cluster.gpus["MyGPU"].source == ""
