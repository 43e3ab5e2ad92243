"""torch.profiler traces as measurements: a rank's steps, compute, communication and idle time worked by hand;
`fasop validate` on a run folder of traces (the step time, each stage beside the estimate); bad traces in one
line."""

from __future__ import annotations

import json

import pytest
from test_validate_calibrate import NODES, write_run

from fasop.calibration.measured import read_measured
from fasop.calibration.traces import read_trace, stage_medians
from fasop.cli import main


def kernel(name: str, start_us: float, dur_us: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "pid": 0, "tid": 7, "ts": start_us, "dur": dur_us}


def step(number: int, start_us: float, dur_us: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{number}", "pid": 1, "tid": 1,
            "ts": start_us, "dur": dur_us}


def trace(rank: int, scale: float = 1.0) -> dict:
    """Two steps of 1000 and 1200 us: compute kernels of 300 + 200 us, an NCCL kernel of 100 us overlapping the
    second by 50 us, and in step 2 a kernel that starts in it and runs past its end (counted to the end)."""
    events = [
        step(3, 0, 1000), step(4, 2000, 1200),
        kernel("ampere_sgemm_128x64_tn", 100 * scale, 300), kernel("vectorized_elementwise_kernel", 450, 200),
        kernel("ncclDevKernel_AllReduce_Sum_f16_RING_LL", 600, 100),
        kernel("ampere_sgemm_128x64_tn", 2000, 400), kernel("ncclKernel_SendRecv", 2500, 300),
        kernel("void at::native::reduce_kernel", 3100, 500),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},  # host work: not the GPU's
    ]
    return {"schemaVersion": 1, "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2},
            "traceEvents": events}


def test_a_ranks_steps_by_hand(tmp_path):
    path = tmp_path / "worker0.1.pt.trace.json"
    path.write_text(json.dumps(trace(0)))
    found = read_trace(path)
    assert found.rank == 0 and len(found.steps) == 2
    first, second = found.steps
    # step 3: compute 300 + 200, NCCL 100 (50 of it beside compute); busy 100..400 and 450..700: 550 us
    assert (first.step_s, first.compute_s, first.communication_s) == pytest.approx((1e-3, 5e-4, 1e-4))
    assert first.idle_s == pytest.approx(1e-3 - 5.5e-4)
    # step 4: compute 400 and 100 (of 500, to the step's end at 3200), NCCL 300; busy 400 + 300 + 100
    assert (second.step_s, second.compute_s, second.communication_s) == pytest.approx((1.2e-3, 5e-4, 3e-4))
    assert second.idle_s == pytest.approx(1.2e-3 - 8e-4)
    assert found.median().step_s == pytest.approx(1.1e-3)


def test_stages_follow_megatrons_rank_order(tmp_path):
    traces = []
    for rank in range(4):
        path = tmp_path / f"r{rank}.trace.json"
        path.write_text(json.dumps(trace(rank)))
        traces.append(read_trace(path))
    # tp 2 x dp 1 per stage: ranks 0, 1 on stage 0 and 2, 3 on stage 1; a pp 3 plan has a stage no trace covers
    assert [s is not None for s in stage_medians(traces, 2, 1, 2)] == [True, True]
    assert stage_medians(traces, 2, 1, 3)[2] is None


def test_validate_reads_a_folder_of_traces_and_sets_each_stage_beside_the_estimate(tiny, runner):
    user = tiny("user", nodes=NODES)
    logs = user.root / "logs"
    write_run(logs / "a", user, "no reports here\n", pp=2, dp=1, layers_per_stage=[2, 2])
    for rank in (0, 1):
        (logs / "a" / f"worker{rank}.pt.trace.json").write_text(json.dumps(trace(rank)))
    runs = read_measured(logs)
    assert [r.label for r in runs] == ["a (traces)"]
    assert runs[0].measured_step_s == pytest.approx(1.1e-3) and len(runs[0].stages) == 2
    result = runner.invoke(main, ["validate", "--measured", str(logs), "--profiles", str(user.profiles)])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert any(line.startswith("a (traces)") and "0.0011" in line for line in lines)
    at = lines.index("a (traces): seconds per step, measured (traces) / estimated")
    assert lines[at + 1].split() == ["stage", "compute", "communication", "idle"]
    assert [line.split()[0] for line in lines[at + 2:at + 4]] == ["0", "1"]
    assert lines[at + 2].split()[1] == "0.0005"  # the median step's compute on stage 0


@pytest.mark.parametrize("text, fragments", [
    ("{not json", ["not JSON"]),
    (json.dumps({"events": []}), ["traceEvents list"]),
    (json.dumps({"traceEvents": [kernel("k", 0, 10)]}), ["no ProfilerStep#N spans"]),
    (json.dumps({"traceEvents": [step(1, 0, 10)]}), ["no GPU kernels"]),
    (json.dumps({"traceEvents": [step(1, 0, 10), kernel("k", -5, 10)]}), ["'k'", "ts microseconds >= 0"]),
    (json.dumps({"traceEvents": [step(1, 0, "10"), kernel("k", 0, 10)]}), ["ProfilerStep#1", "dur"]),
    (json.dumps({"distributedInfo": {"rank": -1}, "traceEvents": [step(1, 0, 10), kernel("k", 0, 10)]}),
     ["distributedInfo.rank"]),
    (json.dumps({"distributedInfo": {"rank": 5}, "traceEvents": [step(1, 0, 10), kernel("k", 0, 10)]}),
     ["rank 5 is beyond the plan's 2 GPUs"]),
])
def test_bad_traces_are_one_line(tiny, runner, text, fragments):
    user = tiny("user", nodes=NODES)
    write_run(user.root / "logs" / "a", user, "no reports here\n", pp=2, dp=1, layers_per_stage=[2, 2])
    (user.root / "logs" / "a" / "w.pt.trace.json").write_text(text)
    result = runner.invoke(main, ["validate", "--measured", str(user.root / "logs"), "--profiles", str(user.profiles)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and "w.pt.trace.json" in lines[0], result.stderr
    assert all(fragment in lines[0] for fragment in fragments), lines[0]
