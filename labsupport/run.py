"""Run a lab's function under ``torchrun``: ``python -m labsupport.run module:function``.

A lab calls ``launch(fn, world_size=4)``; on a cluster the same function runs with::

    torchrun --nproc-per-node 4 -m labsupport.run labsupport.labs.lab06_launching:world_info
    torchrun --nnodes 2 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id job1 \\
        -m labsupport.run labsupport.labs.lab06_launching:world_info

Each rank initialises the default process group from torchrun's environment
(``cpu:gloo,cuda:nccl`` when each local rank has a GPU, gloo otherwise; ``--backend``
overrides), calls the function
with the keyword arguments given as ``name=value`` (values parsed as Python literals),
prints what it returned as ``[rank N] -> value``, and tears the group down.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys

import torch.distributed as dist

from labsupport.launch import runtime


def resolve(target: str):
    """``"package.module:function"`` -> the function."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise SystemExit(
            "expected module:function "
            f"(e.g. labsupport.labs.lab06_launching:world_info), got {target!r}"
        )
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise SystemExit(f"{target} is not callable")
    return obj


def parse_kwargs(items: list[str]) -> dict:
    """``["n=3", "name='x'"]`` -> ``{"n": 3, "name": "x"}``; bare words stay strings."""
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise SystemExit(f"arguments are name=value pairs, got {item!r}")
        try:
            kwargs[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            kwargs[key] = value
    return kwargs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m labsupport.run", description=__doc__.split("\n")[0]
    )
    parser.add_argument("target", help="module:function to call on every rank")
    parser.add_argument("kwargs", nargs="*", help="keyword arguments as name=value")
    parser.add_argument("--backend", default="auto", help="auto (default), gloo or nccl")
    parser.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    args = parser.parse_args(argv)
    if "RANK" not in os.environ:
        raise SystemExit(
            "labsupport.run expects the environment torchrun sets (RANK, WORLD_SIZE, ...): "
            "start it with `torchrun --nproc-per-node N -m labsupport.run module:function`, "
            "or call labsupport.launch(fn, world_size=N) from Python."
        )
    fn = resolve(args.target)
    kwargs = parse_kwargs(args.kwargs)
    runtime.init_process_group(args.backend, timeout=args.timeout)
    try:
        result = fn(**kwargs)
        if result is not None:
            # One write per line, so lines of ranks sharing a pipe do not interleave.
            sys.stdout.write(f"[rank {dist.get_rank()}] -> {result!r}\n")
            sys.stdout.flush()
    finally:
        if dist.is_initialized():  # fn may have torn it down itself
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
