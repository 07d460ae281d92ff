"""The commands that work on checkpoint files, without Ray: ``inspect``, ``plan``,
``convert``, ``make-checkpoint``."""

from __future__ import annotations

import argparse

from rayload.cli.common import HF_LAYOUTS, AddCommand, add_dir, add_json
from rayload.cli.fields import add_field_flag


def _cmd_inspect(args: argparse.Namespace) -> int:
    import json

    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.describe import describe_checkpoint, render_checkpoint

    summary = describe_checkpoint(open_checkpoint(args.dir))
    print(json.dumps(summary) if args.json else render_checkpoint(summary))
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    import json

    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.describe import describe_plan, render_plan
    from rayload.loading.plan import plan_shards

    checkpoint = open_checkpoint(args.dir)
    plan = plan_shards(
        checkpoint, args.tp_size, rules=args.rules, expert_parallel=args.expert_parallel
    )
    summary = describe_plan(plan, checkpoint.root)
    print(json.dumps(summary) if args.json else render_plan(summary))
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    from rayload.loading.convert import convert_checkpoint
    from rayload.loading.manifest import MANIFEST_NAME

    out = convert_checkpoint(
        args.dir, args.out, args.tp_size, rules=args.rules, expert_parallel=args.expert_parallel
    )
    print(f"converted {args.dir} for tp={args.tp_size}: {out / MANIFEST_NAME}")
    return 0


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from rayload.loading.checkpoint import open_checkpoint
    from rayload.loading.describe import human_bytes
    from rayload.loading.synthetic import write_checkpoint

    out = write_checkpoint(
        args.out,
        preset=args.preset,
        size_gb=args.size_gb,
        dtype=args.dtype,
        num_files=args.files,
        seed=args.seed,
    )
    checkpoint = open_checkpoint(out)
    print(
        f"wrote {out}: {args.preset}, {len(checkpoint.tensors)} tensors, "
        f"{human_bytes(checkpoint.tensor_bytes)} in {len(checkpoint.files)} files"
    )
    return 0


def _add_plan_fields(p: argparse.ArgumentParser) -> None:
    """``--tp``, ``--rules``, ``--expert-parallel``: the load's fields a plan depends on."""
    add_field_flag(p, "tp_size", overridable=False, required=True)
    add_field_flag(p, "rules", overridable=False)
    add_field_flag(p, "expert_parallel", overridable=False)


def add_commands(add: AddCommand) -> None:
    from rayload.loading.synthetic import DTYPES, FILE_TARGET_BYTES, PRESETS

    p = add("inspect", _cmd_inspect, "list a checkpoint's files, tensors, dtypes and shapes")
    add_dir(p)
    add_json(p, "the summary")

    p = add("plan", _cmd_plan, "show per-rank bytes, replicated bytes and read amplification")
    add_dir(p)
    _add_plan_fields(p)
    add_json(p, "the plan")

    p = add("convert", _cmd_convert, "write a pre-sharded checkpoint for one tp size")
    add_dir(p, f"the Hugging Face checkpoint to convert: {HF_LAYOUTS}; or one .safetensors file")
    p.add_argument("out", help="output directory: new, or empty")
    _add_plan_fields(p)

    p = add(
        "make-checkpoint",
        _cmd_make_checkpoint,
        "write a synthetic Llama- or Mixtral-shaped checkpoint",
    )
    p.add_argument("out", help="output directory: new, or one that holds no checkpoint")
    p.add_argument(
        "--preset",
        default="tiny-llama",
        choices=list(PRESETS),
        help="model shape: %(choices)s (default: %(default)s)",
    )
    p.add_argument(
        "--size-gb",
        type=float,
        metavar="GB",
        help="scale the layer count to about this many GB (default: the preset's layers)",
    )
    p.add_argument(
        "--dtype",
        default="bf16",
        choices=list(DTYPES),
        help="tensor dtype: %(choices)s (default: %(default)s)",
    )
    p.add_argument(
        "--files",
        type=int,
        metavar="N",
        help="number of safetensors files "
        f"(default: one per {FILE_TARGET_BYTES >> 20} MiB, at least 2)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        metavar="N",
        help="seed of the random values (default: %(default)s)",
    )
