"""How well one measured micro-batch size predicts the others, and how far `fasop profile synth` lands from
measured profiles.

    python scripts/measure_mbs_scaling.py [--part scaling|floor|synth|plans|all]

1. scaling: for every measured profile with several micro-batch sizes, each larger size's forward + backward time
   predicted from the smallest profiled one, (a) per sample, t(b0) x b / b0 (fasop's first rule), (b) by the
   roofline shape, t(b0) x r(b) / r(b0) (its second), and (c) as fasop does today, the measured time split into
   the host's and the GPU's part on the roofline's launch queue (fasop.inputs.profiles.Curve), with the host floor
   the profile carries (H100-mbs32: measured by fasop profile layers), else the catalogue's kernel_launch_us.
   Error = predicted / measured - 1, per GPU, model and tensor degree over all units and sizes. The profiles:
   H100-measured (fasop profile layers on one H100, tp 1, mbs 1 to 8; roofline of the catalogue's H100),
   H100-mbs32 (the same, mbs 1 to 32, validation/profiles) and FASOP's A100 and A10 profiles (bundled, converted
   by scripts/convert_fasop_profiles.py). FASOP's own .npy files hold one size per tensor degree (mbs 1); their
   other sizes are FASOP's micro-batch factors, fitted by FASOP to its measurements, at the factors' breakpoints
   only (bert and t5; gpt2-xl's factors are per sample, so it has no second size).
2. floor: the H100-mbs32 profiles' micro-batch 32 predicted from micro-batch 1 alone, per unit and for the whole
   model (embedding, every layer, head; forward + backward): with the host floor the profile measured, with the
   catalogue's kernel_launch_us instead, and by the roofline shape (validation/profiles/README.md).
3. synth: the synthesised time of a whole model (embedding, every layer, head; forward + backward, mbs 1) and of
   one layer against FASOP's measured A100 and A10 profiles at tp 1, 2, 4, and against H100-measured at mbs 1 to
   8. Only `fasop.profile.synth.synthesize` is used, so the same part runs on older checkouts.
4. plans: the best plan of each of FASOP's six experiments under FASOP's measured profiles, its step time
   estimated again with A100 and A10 profiles from `fasop profile synth` (catalogue efficiencies, tp 1, 2, 4,
   mbs 1, 2, 4, 8): measured step / synthesised step. Public API only, so it too runs on older checkouts.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import replace
from pathlib import Path

from fasop.inputs.catalogue import load_gpu_spec
from fasop.inputs.model import load_model
from fasop.inputs.profiles import load_profiles
from fasop.profile.synth import header_lines, synthesize, write_profile

ROOT = Path(__file__).resolve().parents[1]
# (profile GPU type, catalogue GPU whose roofline shapes it, models, profile folder: None for the bundled ones)
MEASURED = [("H100-measured", "H100", ("gpt2-xl", "llama2-7b", "bert", "t5"), None),
            ("H100-mbs32", "H100", ("bert", "gpt2-xl"), ROOT / "validation" / "profiles"),
            ("A100", "A100", ("bert", "t5"), None), ("A10", "A10", ("bert", "t5"), None)]
FASOP = [("A100", ("gpt2-xl", "bert", "t5")), ("A10", ("gpt2-xl", "bert", "t5"))]
EXPERIMENTS = [("gpt2-xl", "fasop-8xA10"), ("gpt2-xl", "fasop-1xA100-7xA10"), ("bert", "fasop-4xA10"),
               ("bert", "fasop-1xA100-3xA10"), ("t5", "fasop-8xA10"), ("t5", "fasop-1xA100-7xA10")]


def scaling() -> None:
    import numpy as np

    from fasop.inputs.catalogue import load_gpu_specs
    from fasop.inputs.profiles import Curve, roofline_shape  # newer than the other parts: only this part needs it

    specs = load_gpu_specs()
    print("Predicting each profiled micro-batch size from the smallest one (forward + backward, every unit):")
    print("| profile | model | tp | sizes | per sample: mean, worst | roofline shape: mean, worst | host floor split: "
          "mean, worst |")
    print("|---|---|---|---|---|---|---|")
    for gpu, spec_name, models, folder in MEASURED:
        for name in models:
            model = load_model(name)
            profile = load_profiles(model, [gpu], None if folder is None else str(folder / name), specs={})[gpu]
            spec = specs[spec_name]
            floored = spec if profile.kernel_launch_us is None else replace(spec, kernel_launch_us=profile.kernel_launch_us)
            for tp in profile.tensor_degrees:
                errors: tuple[list[float], list[float], list[float]] = ([], [], [])
                sizes = set()
                for (curve_tp, kind), curve in sorted(profile.curves.items()):
                    if curve_tp != tp or len(curve.mbs) < 2:
                        continue
                    shape = roofline_shape(model, spec, tp, kind)
                    b0, t0 = int(curve.mbs[0]), curve.forward_s[0] + curve.backward_s[0]
                    r0 = sum(shape(b0))
                    first = Curve(curve.mbs[:1], curve.forward_s[:1], curve.backward_s[:1],
                                  roofline_shape(model, floored, tp, kind))
                    for b, f, w in zip(curve.mbs[1:], curve.forward_s[1:], curve.backward_s[1:]):
                        sizes.add(int(b))
                        for found, predicted in zip(errors, (t0 * b / b0, t0 * sum(shape(int(b))) / r0,
                                                             float(np.sum(first.at(int(b)))))):
                            found.append(predicted / (f + w) - 1)
                if errors[0]:
                    print(f"| {gpu} | {name} | {tp} | {','.join(map(str, sorted(sizes)))} | "
                          + " | ".join(summary(e) for e in errors) + " |")


def floor() -> None:
    from fasop.inputs.catalogue import load_gpu_specs
    from fasop.inputs.model import with_precision
    from fasop.inputs.profiles import Curve, roofline_shape

    spec = load_gpu_specs()["H100"]
    print("H100-mbs32: micro-batch 32 predicted from micro-batch 1, predicted / measured (forward + backward):")
    print("| model | unit | host floor split, measured floor | the same, the catalogue's floor | roofline shape |")
    print("|---|---|---|---|---|")
    for name in ("bert", "gpt2-xl"):
        model = load_model(name)
        profile = load_profiles(model, ["H100-mbs32"], str(ROOT / "validation" / "profiles" / name), specs={})
        profile = profile["H100-mbs32"]
        shaped = with_precision(model, profile.precision or model.precision)
        floored = replace(spec, kernel_launch_us=profile.kernel_launch_us)
        totals = [0.0, 0.0, 0.0, 0.0]  # measured, split, split at the catalogue's floor, shape
        for kind in ("layer", "head", "embedding"):
            curve = profile.curves[(1, kind)]
            count = model.num_layers if kind == "layer" else 1
            measured = curve.forward_s[-1] + curve.backward_s[-1]
            split = [sum(Curve(curve.mbs[:1], curve.forward_s[:1], curve.backward_s[:1],
                               roofline_shape(shaped, gpu, 1, kind)).at(32)) for gpu in (floored, spec)]
            shape = roofline_shape(shaped, spec, 1, kind)
            proportional = (curve.forward_s[0] + curve.backward_s[0]) * sum(shape(32)) / sum(shape(1))
            for i, value in enumerate((measured, *split, proportional)):
                totals[i] += count * value
            print(f"| {name} | {kind} | " + " | ".join(f"{v / measured:.2f}" for v in (*split, proportional)) + " |")
        print(f"| {name} | whole model | " + " | ".join(f"{v / totals[0]:.2f}" for v in totals[1:]) + " |")


def summary(errors: list[float]) -> str:
    worst = max(errors, key=abs)
    return f"{100 * sum(map(abs, errors)) / len(errors):.0f}%, {100 * worst:+.0f}%"


def model_s(model, times) -> float:
    """Forward + backward of the whole model from {kind: (forward_s, backward_s)}."""
    total = sum(sum(times[kind]) for kind in times if kind not in model.layer_kinds)
    return total + sum(n * sum(times[kind]) for n, kind in zip(model.segment_layers, model.layer_kinds))


def synth() -> None:
    print("Measured / synthesised forward + backward at mbs 1 (catalogue efficiencies), whole model and one layer:")
    print("| GPU | model | tp | measured model ms | synth model ms | model ratio | layer ratio |")
    print("|---|---|---|---|---|---|---|")
    for gpu, models in FASOP:
        for name in models:
            model = load_model(name)
            profile = load_profiles(model, [gpu])[gpu]
            for tp in profile.tensor_degrees:
                rows = {r.kind: (r.forward_s, r.backward_s) for r in synthesize(model, gpu, [tp], [1])}
                measured = {kind: profile.time(tp, kind, 1) for kind in rows}
                layer = model.layer_kinds[0]
                print(f"| {gpu} | {name} | {tp} | {1e3 * model_s(model, measured):.1f} | {1e3 * model_s(model, rows):.1f} "
                      f"| {model_s(model, measured) / model_s(model, rows):.2f} | "
                      f"{sum(measured[layer]) / sum(rows[layer]):.2f} |")
    print()
    print("H100-measured / synthesised H100, tp 1, forward + backward of one layer and of the whole model:")
    print("| model | mbs | layer ratio | model ratio |")
    print("|---|---|---|---|")
    for name in ("gpt2-xl", "llama2-7b", "bert", "t5"):
        model = load_model(name)
        profile = load_profiles(model, ["H100-measured"])["H100-measured"]  # profiled sizes: times as measured
        for mbs in (1, 2, 4, 8):
            rows = {r.kind: (r.forward_s, r.backward_s) for r in synthesize(model, "H100", [1], [mbs])}
            measured = {kind: profile.time(1, kind, mbs) for kind in rows}
            layer = model.layer_kinds[0]
            print(f"| {name} | {mbs} | {sum(measured[layer]) / sum(rows[layer]):.2f} | "
                  f"{model_s(model, measured) / model_s(model, rows):.2f} |")


def plans() -> None:
    from fasop import estimate, load_cluster
    from fasop.search import search_plans
    from fasop.search.spec import spec_of

    print("Best plan under FASOP's measured profiles, measured step / step with synthesised A100 and A10 profiles:")
    print("| model | cluster | plan | measured step s | synth step s | ratio |")
    print("|---|---|---|---|---|---|")
    for name, cluster_name in EXPERIMENTS:
        model, cluster = load_model(name), load_cluster(cluster_name)
        best = search_plans(model, cluster).plans[0]
        with tempfile.TemporaryDirectory() as folder:
            for gpu in ("A100", "A10"):
                sizes = ((1, 2, 4), (1, 2, 4, 8))
                write_profile(Path(folder) / f"{gpu}.csv", synthesize(model, gpu, *sizes),
                              header_lines(model, load_gpu_spec(gpu), *sizes))
            synthetic = estimate(model, cluster, spec_of(best, model, cluster), profiles_dir=folder)
        shape = f"tp{best.tp} dp{best.dp} pp{best.pp} mbs{best.mbs}"
        print(f"| {name} | {cluster_name} | {shape} | {best.step_time_s:.4f} | {synthetic.step_time_s:.4f} | "
              f"{best.step_time_s / synthetic.step_time_s:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["scaling", "floor", "synth", "plans", "all"], default="all")
    args = parser.parse_args()
    for part, run in (("scaling", scaling), ("floor", floor), ("synth", synth), ("plans", plans)):
        if args.part in (part, "all"):
            run()
            print()


if __name__ == "__main__":
    main()
