"""The options of an emitted run that `fasop emit` and `fasop search --emit` share: a smoke test or a full run's
data and tokenizer, and training hyperparameters. Only click here: `fasop search` loads the launch code only
when it emits."""

from __future__ import annotations

from typing import Any

import click

from fasop.errors import InputError

_TABLE = "Overrides the [launch] table of the cluster file."

_OPTIONS: tuple[tuple[str, str, dict[str, Any]], ...] = (
    ("--smoke-test", "A short run (--train-iters, default 50; mock data without --data-path) without checkpoints: "
                     "the only run that needs neither the plan's train_steps nor a data path and tokenizer.",
     {"is_flag": True, "default": None}),
    ("--data-path", "Megatron-LM --data-path; a full run needs it and a tokenizer. " + _TABLE, {"metavar": "PREFIX"}),
    ("--tokenizer-type", "Megatron-LM --tokenizer-type (default with --vocab-file: GPT2BPETokenizer or "
                         "BertWordPieceLowerCase by model; a smoke test without one: NullTokenizer). " + _TABLE, {}),
    ("--tokenizer-model", "Megatron-LM --tokenizer-model (e.g. a Hugging Face tokenizer's folder or name, with "
                          "--tokenizer-type HuggingFaceTokenizer). " + _TABLE, {"metavar": "FILE"}),
    ("--vocab-file", "Megatron-LM --vocab-file. " + _TABLE, {"metavar": "FILE"}),
    ("--merge-file", "Megatron-LM --merge-file. " + _TABLE, {"metavar": "FILE"}),
    ("--training", "A [training] hyperparameter over the model file's (lr, min_lr, lr_decay_style, "
                   "lr_warmup_fraction, weight_decay, adam_beta1, adam_beta2, adam_eps, clip_grad, init_method_std); "
                   "repeatable.", {"multiple": True, "metavar": "KEY=VALUE"}),
)

NAMES = ("smoke_test", "data_path", "tokenizer_type", "tokenizer_model", "vocab_file", "merge_file", "training")


def run_options(command):
    """The options above, added to the command's keyword arguments under NAMES."""
    for flag, help_text, keywords in reversed(_OPTIONS):
        keywords = {"default": None, **keywords}
        command = click.option(flag, help=help_text, **keywords)(command)
    return command


def run_settings(values: dict[str, Any]) -> dict[str, Any]:
    """The options' values as launch options take them: `training` as {key: value}."""
    settings = dict(values)
    pairs = {}
    for value in settings.get("training") or ():
        key, sep, text = value.partition("=")
        if not sep or not key or not text:
            raise InputError(f"--training {value}", "expected KEY=VALUE, such as lr=3e-4")
        pairs[key] = text
    settings["training"] = pairs
    return settings
