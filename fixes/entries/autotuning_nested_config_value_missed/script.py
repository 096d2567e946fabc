"""The user's training script (``train.py``), which the autotuner launches for every experiment.

Its command-line arguments override the DeepSpeed config it is given: that is why the config's
``autotuning.arg_mappings`` names them, so that the autotuner writes each experiment's tuned values into them.
The config comes as a JSON file, or as the base64 JSON the autotuner passes in ``--deepspeed_config``.
"""
from __future__ import annotations

import argparse
import base64
import json
from typing import Any


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train.py")
    parser.add_argument("--deepspeed_config", required=True, help="a JSON file, or base64 JSON")
    parser.add_argument("--per_device_train_batch_size", type=int, default=1)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--lr", type=float, default=0.1)
    return parser.parse_args(argv)


def deepspeed_config(args: argparse.Namespace) -> dict[str, Any]:
    """The config file, with the script's arguments in it (DeepSpeed derives train_batch_size)."""
    if args.deepspeed_config.endswith(".json"):
        with open(args.deepspeed_config) as file:
            config = json.load(file)
    else:
        config = json.loads(base64.urlsafe_b64decode(args.deepspeed_config))
    config.pop("train_batch_size", None)
    config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    config["zero_optimization"] = {**config.get("zero_optimization", {}), "stage": args.zero_stage}
    return config


def train(argv: list[str], steps: int) -> Any:
    """``python train.py ARGV``: SGD on the tiny MLP for ``steps`` optimizer steps; returns the engine."""
    import deepspeed
    import torch

    from fixes.harness import ModelSpec, TinyMLP, device, make_batches, mse

    args = parse_args(argv)
    config = deepspeed_config(args)
    model = TinyMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    batches = make_batches(ModelSpec(), steps, micro_batch=engine.train_micro_batch_size_per_gpu())
    for step in range(steps):
        x, y = batches.micro(step, 0, 0)
        loss = mse(engine(x.to(device())), y.to(device()))
        engine.backward(loss)
        engine.step()
    return engine
