"""Convert FASOP's measured layer profiles into fasop's profile CSVs.

Usage: python scripts/convert_fasop_profiles.py SOURCE_DIR [--out profiles]

SOURCE_DIR holds FASOP's (HPDC 2024) `known_cost` arrays, `<model>_<gpu>_<tp>.npy`: one float64 entry per
partition unit, the measured forward time in seconds of that unit for one micro-batch on one GPU of a tp-way
group. For each model and GPU this writes `<out>/<model>/<gpu>.csv` (format: docs/formats.md, "Profiles").

FASOP scales the single measurement per unit with hand-fitted micro-batch factors phi(model, gpu, kind, b)
and counts forward + backward as 3 x forward. Here forward_s = phi * measured and backward_s = 2 * forward_s.
The factors become data rows: one row at each micro-batch size where FASOP's factor chain has a breakpoint
(always including mbs 1), so that FASOP's own rule - linear interpolation between breakpoints, per-sample
scaling beyond the last - gives back FASOP's factor at every power-of-two micro-batch size up to 256. fasop
itself scales between and beyond the rows by the roofline shape of each unit (docs/cost-model.md section 2),
so it agrees with FASOP's factors at the breakpoints only.

FASOP quirks deliberately NOT reproduced:
- gpt2XL A100 embedding/head are not scaled with b in FASOP; here they use phi = b, like A10.
- bert A100 layer uses 1.236 at b=8 but 1.235*1.658 at b=16 (typo); here 1.236 is used for both.
- T5 A100 decoder-embedding chain (1.126, 1.080, 1.090, 1.596, 1.529) is dead code in FASOP, which applies
  the encoder-embedding chain to both embeddings; here the decoder chain is used for decoder_embedding.

T5 has no separate head entry: FASOP folded the decoder's post-process into the last decoder entry and the
encoder's post-process into the last encoder entry, so head = (last decoder - decoder) + (last encoder -
encoder), scaled with the decoder factor.
"""

import argparse
from pathlib import Path

import numpy as np

MODELS = {"gpt2XL": "gpt2-xl", "bert": "bert", "T5": "t5"}  # FASOP file prefix -> fasop model name
GPUS = ("A100", "A10")
TPS = (1, 2, 4)
KINDS = {
    "gpt2-xl": ("embedding", "layer", "head"),
    "bert": ("embedding", "layer", "head"),
    "t5": ("embedding", "encoder", "decoder_embedding", "decoder", "head"),
}
UNITS = {"gpt2-xl": 50, "bert": 26, "t5": 50}  # entries per file: L transformer layers + 2


def chain(*steps, flat_to=1):
    """Rows (mbs, phi) of a FASOP factor chain.

    phi is 1 up to mbs `flat_to`, then each doubling of mbs multiplies it by the next step; beyond the
    last row FASOP continues the chain per sample ("else ... * b / b_last").
    """
    rows = [(1, 1.0)] + ([(flat_to, 1.0)] if flat_to > 1 else [])
    mbs, phi = flat_to, 1.0
    for step in steps:
        mbs, phi = 2 * mbs, phi * step
        rows.append((mbs, phi))
    return rows


PER_SAMPLE = chain()  # phi = b

# FASOP's micro-batch factors (reference get_cost_e), as breakpoint rows per (model, gpu) and kind.
PHI = {
    ("gpt2-xl", "A100"): {"embedding": PER_SAMPLE, "layer": PER_SAMPLE, "head": PER_SAMPLE},
    ("gpt2-xl", "A10"): {"embedding": PER_SAMPLE, "layer": PER_SAMPLE, "head": PER_SAMPLE},
    ("bert", "A100"): {
        "embedding": chain(1.385, 1.589, 1.565, flat_to=4),  # b<8: 1; 8, 16, 32: chain; else * b/32
        "layer": chain(1.236, 1.658, flat_to=4),  # b<8: 1; 8, 16: chain; else * b/16
        "head": PER_SAMPLE,
    },
    ("bert", "A10"): {
        "embedding": chain(flat_to=4),  # b<4: 1; else b/4
        "layer": chain(2.0, flat_to=4),  # b<8: 1; else b/4 (so b=8 costs 2x, b=4 the same as b=1)
        "head": PER_SAMPLE,
    },
    ("t5", "A100"): {
        "embedding": chain(1.386, 1.244, 1.356, 1.055, 1.368),  # 1..32: chain; else * b/32
        "encoder": chain(1.173, 1.489, flat_to=2),  # b<4: 1; 4, 8: chain; else * b/8
        "decoder_embedding": chain(1.126, 1.080, 1.090, 1.596, 1.529),
        "decoder": chain(1.142, 1.683, flat_to=2),
    },
    ("t5", "A10"): {
        "embedding": chain(1.2, 1.2, 1.4, 1.6),  # 1..16: chain; else * b/16
        "encoder": chain(1.140),  # 1, 2: chain; else 1.140 * b/2
        "decoder_embedding": chain(1.2, 1.2, 1.4, 1.6),  # FASOP has one A10 embedding chain for both
        "decoder": chain(1.094),
    },
}
for _model, _gpu in (("t5", "A100"), ("t5", "A10")):
    PHI[_model, _gpu]["head"] = PHI[_model, _gpu]["decoder"]  # the head is part of the last decoder unit


def all_equal(values, what):
    assert np.all(values == values[0]), f"{what}: replicated layer entries differ"


def unit_times(model, prof, name):
    """Measured forward seconds per unit kind, from one FASOP array."""
    assert prof.shape == (UNITS[model],), f"{name}: expected {UNITS[model]} entries, got {prof.shape}"
    if model != "t5":  # [embedding, L x layer, post-process]
        all_equal(prof[1:-1], name)
        return {"embedding": prof[0], "layer": prof[1], "head": prof[-1]}
    # [embedding, 24 x encoder, decoder embedding, 24 x decoder]; the last encoder and the last decoder
    # entry also contain that stack's post-process, which becomes the head here.
    all_equal(prof[1:24], name)
    all_equal(prof[26:49], name)
    head = (prof[49] - prof[26]) + (prof[24] - prof[1])
    assert head > 0, f"{name}: post-process time {head} is not positive"
    return {"embedding": prof[0], "encoder": prof[1], "decoder_embedding": prof[25], "decoder": prof[26],
            "head": head}


def number(x):
    """12 significant digits: more than the measurements carry, without binary round-off tails."""
    return f"{float(x):.12g}"


def convert(source, prefix, gpu):
    model = MODELS[prefix]
    files = [f"{prefix}_{gpu}_{tp}.npy" for tp in TPS]
    lines = [
        f"# {model} on {gpu}, from FASOP (HPDC 2024) measured layer profiles known_cost/{files[0]},",
        f"# {', '.join(files[1:])} (file suffix = tp; forward seconds of one unit, one micro-batch).",
        "# forward_s = phi(kind, mbs) * measured forward, with phi FASOP's hand-fitted micro-batch factors;",
        "# rows only at the factors' breakpoints; fasop scales between and beyond them by the roofline shape.",
        "# backward_s = 2 * forward_s (FASOP counts forward + backward as 3 x forward).",
    ]
    if model == "t5":
        lines += ["# head = the decoder and encoder post-processes, which FASOP folded into the last decoder and",
                  "# the last encoder entry: (entry 49 - entry 26) + (entry 24 - entry 1); scaled like decoder."]
    lines += ["# Written by scripts/convert_fasop_profiles.py.",
              f"# fasop-profile: model={model} gpu={gpu}",  # what fasop checks (docs/formats.md)
              "tp,mbs,kind,forward_s,backward_s"]
    rows = []
    for tp, name in zip(TPS, files):
        times = unit_times(model, np.load(source / name), name)
        for kind in KINDS[model]:
            for mbs, phi in PHI[model, gpu][kind]:
                forward = phi * float(times[kind])
                rows.append(f"{tp},{mbs},{kind},{number(forward)},{number(2 * forward)}")
    return model, "\n".join(lines + rows) + "\n", len(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, metavar="SOURCE_DIR", help="directory of FASOP's .npy profiles")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "profiles",
                        help="profiles directory to write (default: the bundled profiles/)")
    args = parser.parse_args(argv)
    for prefix in MODELS:
        for gpu in GPUS:
            model, text, count = convert(args.source, prefix, gpu)
            path = args.out / model / f"{gpu}.csv"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8", newline="\n")
            print(f"wrote {path} ({count} rows)")


if __name__ == "__main__":
    main()
