"""`swarm train`: train a model on this machine or across the swarm, by a plan from the planners."""
from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path

from swarm.commands.flags import (IMG_SIZE_HELP, add_network_args, add_token_args, image_size, model_name,
                                  non_negative_float, non_negative_int, positive_float, positive_int)
from swarm.errors import SwarmError
from swarm.local.progress import format_seconds

STRATEGIES = ("auto", "local", "dp", "pp", "tiles", "hybrid")


def steps_or_auto(text: str) -> int:
    """--backup-every: a number of steps, or "auto" (0)."""
    if text == "auto":
        return 0
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc}; give a number of steps (1 or more) or auto") from None


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="train a model", description=(
        "Train a model. With no other device on the network (or --strategy local) it trains on "
        "this machine; with no --data it uses the built-in synthetic shapes data set."))
    p.add_argument("--model", type=model_name,
                   help="a built-in model (yolov2-16, the default; yolov2, yolov2-tiny, yolov3-tiny, "
                   "yolov4-tiny, yolov7-tiny, darknet53, resnet18, resnet50, mobilenetv2, efficientnet-b0, vgg16, "
                   "alexnet, lenet5: the README's table) or a .cfg path")
    p.add_argument("--img-size", type=image_size, metavar="N|WxH", help=f"input size in pixels: {IMG_SIZE_HELP} "
                   "(default: 128 for the built-in YOLO models whatever the data (256 yolov4-tiny), 64 the classifiers, 96 "
                   "alexnet, 32 lenet5; "
                   "a .cfg file's own width and height)")
    p.add_argument("--data", help="a YOLO-format folder (images/, labels/); default: built-in synthetic shapes")
    p.add_argument("--classes", type=positive_int, help="number of classes for a built-in model (default: the data's)")
    p.add_argument("--strategy", choices=STRATEGIES, default="auto", help="how to split the work over the devices "
                   "running `swarm join`: auto (default; this machine alone when no other device answers), local "
                   "(this machine, no discovery), dp, pp, tiles, hybrid")
    p.add_argument("--plan", metavar="FILE", help="run this plan (JSON, as `swarm plan --out` writes)")
    p.add_argument("--devices", type=positive_int, metavar="N", help="use N devices (waits for them; default: "
                   "every device that answers)")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b", help="micro-batch order of pipeline "
                   "stages: 1f1b (default; Asteroid's warm-up, least memory) or gpipe (all forwards first)")
    p.add_argument("--wait", type=non_negative_float, metavar="SECONDS",
                   help="how long to look for devices (default: 2; with --devices N, up to 60 for them to answer)")
    p.add_argument("--stages", type=positive_int, metavar="N", help="pp: number of pipeline stages (default: one "
                   "per device)")
    p.add_argument("--grid", metavar="RxC", help="tiles: split each feature map into R rows x C columns of tiles")
    p.add_argument("--sync", metavar="LAYERS", help="tiles: layers where tiles exchange halos going forward, e.g. "
                   "0,4,8 (groups 0-3, 4-7, 8-...); 'all' (default: every layer) or 'none' (one fused group)")
    p.add_argument("--together", type=positive_int, metavar="N", help="tiles over the whole model: run N "
                   "micro-batches through the tiles at once (one exchange per layer for all of them; each keeps its "
                   "own BatchNorm statistics, so the model is the same). Default: as many as fit in the devices' "
                   "memory")
    p.add_argument("--replicas", type=positive_int, metavar="R", help="tiles: split the devices into R groups, "
                   "each with its own grid running 1/R of the micro-batches at the same time (halos and BatchNorm "
                   "sums stay inside a group; the model is the same; default 1). dp: R devices each run whole "
                   "micro-batches (1 shares every micro-batch among the devices; default: whichever keeps more "
                   "devices busy)")
    p.add_argument("--in-process", action="store_true", help="run the strategy's work in this process (tiles one "
                   "after another; other strategies as if on 4 devices, or --devices N) instead of on other devices")
    p.add_argument("--batch-size", type=positive_int, help="samples per optimizer step (default: 16)")
    p.add_argument("--microbatches", type=positive_int, help="micro-batches per step (default: 1)")
    p.add_argument("--steps", type=positive_int, help="total optimizer steps (default: 300)")
    p.add_argument("--epochs", type=positive_float, help="train for this many passes over the data instead")
    p.add_argument("--optimizer", choices=("sgd", "adam"), help="sgd (default, momentum 0.9) or adam")
    p.add_argument("--lr", type=positive_float, help="learning rate (default: 0.001)")
    p.add_argument("--momentum", type=non_negative_float, help="SGD momentum (default: 0.9)")
    p.add_argument("--weight-decay", type=non_negative_float, help="weight decay on weights (default: 5e-4)")
    p.add_argument("--lr-drops", type=lr_drops, metavar="N,M|none", help="steps from which the learning rate is a "
                   "tenth as large again, as darknet's policy=steps (default: at 80%% and 90%% of the run's steps); "
                   "none: constant after the warm-up")
    p.add_argument("--warmup", type=non_negative_int, help="steps of learning-rate warm-up (default: 20)")
    p.add_argument("--seed", type=non_negative_int, help="fixes initial weights and sample order (default: 0)")
    p.add_argument("--augment", choices=("on", "off"), help="on (default): each training sample shifted, flipped and "
                   "recoloured as the cfg's jitter, flip, hue, saturation, exposure, angle and mosaic say (darknet's "
                   "defaults where it says nothing), drawn from the sample and the step so every plan sees the same; "
                   "off: samples as they are")
    p.add_argument("--anchors", choices=("cfg", "auto"), help="the [yolo] heads' anchors: cfg (default) as the "
                   ".cfg writes them, or auto: fitted to the training boxes at the training size when the run starts "
                   "(k-means with IoU, as darknet's calc_anchors; kept in the checkpoint for eval, detect and export; "
                   "`swarm data anchors` shows them)")
    p.add_argument("--dtype", choices=("float32", "float64"), help="arithmetic of weights and activations (default "
                   "float32; float64 is slower but makes every plan agree with --strategy local to ~1e-12)")
    p.add_argument("--accelerator", choices=("cpu", "cuda"), help="where this machine computes with --strategy "
                   "local (or tiles --in-process): cuda (an NVIDIA GPU or a Jetson's) or cpu (default: cuda when "
                   "torch sees one)")
    p.add_argument("--threads", type=positive_int, help="compute threads (default: all usable cores, "
                   "fewer where OMP_NUM_THREADS says)")
    p.add_argument("--save", metavar="PATH", help="checkpoint path (default: swarm-MODEL.pt, or the --resume path)")
    p.add_argument("--save-every", type=non_negative_int, default=0, metavar="N",
                   help="also save every N steps (default: at the end and when interrupted; across devices also "
                   "every 25 steps, so that a lost coordinator costs little)")
    p.add_argument("--recovery", choices=("auto", "light", "heavy"), default="auto",
                   help="after a lost device: shift the plan over the survivors and replay from the last backup "
                   "(light), plan again and reload the last checkpoint (heavy), or whichever suits (auto, default)")
    p.add_argument("--recost", choices=("on", "off"), default="on",
                   help="--strategy auto: once the first steps have run, plan again on the devices' measured speeds "
                   "and switch when that is predicted 10%% faster (on, default), or keep the first plan (off)")
    p.add_argument("--backup-every", type=steps_or_auto, default=0, metavar="N|auto",
                   help="across devices: snapshot and back up every stage every N steps, or (auto, default) as "
                   "often as keeps backups to about a tenth of the time; a device lost later rolls the run back to "
                   "the last backup and replays")
    p.add_argument("--resume", metavar="PATH", help="continue from a checkpoint; flags not given are taken from it")
    p.add_argument("--weights", metavar="FILE", help="start from these weights: darknet .weights (a whole model, or "
                   "a backbone such as darknet19_448.conv.23: the layers it covers) or a swarm checkpoint's model")
    p.add_argument("--metrics", metavar="FILE", help="append one JSON object per step to FILE")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation at the end")
    p.add_argument("--detach", action="store_true", help="hand the run to an agent of the swarm, which coordinates "
                   "it, and return at once with its id (then: `swarm jobs`, `swarm logs`, `swarm stop`, `swarm "
                   "fetch`); paths given (--data, --resume, --weights, --plan) are read on that agent's device")
    p.add_argument("--coordinator", metavar="NAME", help="with --detach: the agent that coordinates the run "
                   "(default: the least loaded)")
    # set by the agent that coordinates a detached run: its id, and a lost coordinator's replica to carry on from
    p.add_argument("--run-id", help=argparse.SUPPRESS)
    p.add_argument("--take-over", metavar="REPLICA", help=argparse.SUPPRESS)
    add_network_args(p)
    add_token_args(p)
    p.set_defaults(run=run)


# Flags that concern this command, not the run: not handed to a detached run's coordinator,
# which sets these itself, and --save and --metrics (where the run writes).
CLIENT_FLAGS = ("help", "detach", "coordinator", "interface", "peers", "state_dir", "token_file")
AGENT_FLAGS = ("save", "metrics", "run_id", "take_over", *CLIENT_FLAGS[1:])


class FlagError(SwarmError):
    pass


class _CheckingParser(argparse.ArgumentParser):
    """`swarm train`'s flags, parsed on an agent: a mistake is an error, never an exit."""

    def error(self, message: str):
        raise FlagError(message)

    def exit(self, status: int = 0, message: str | None = None):
        raise FlagError(message or "asked for help")


def check_detached_flags(flags: list[str]) -> argparse.Namespace:
    """The parsed flags of a run handed to this machine's agent (`swarm train --detach`);
    SwarmError if they are wrong or include flags the agent sets itself."""
    if any(a in ("-h", "--help") for a in flags):
        raise SwarmError("--help is not a run")
    try:
        parsed = train_parser(_CheckingParser).parse_args(flags)
    except FlagError as exc:
        raise SwarmError(f"swarm train: {exc}") from None
    given = ["--" + dest.replace("_", "-") for dest in AGENT_FLAGS if getattr(parsed, dest, None)]
    if given:
        raise SwarmError(f"{', '.join(given)} cannot be given to a detached run: the coordinating agent sets them "
                         f"(fetch its checkpoint with `swarm fetch`)")
    return parsed


def train_parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A parser of `swarm train`'s flags alone (to check and re-write a detached run's)."""
    sub = parser_class(prog="swarm").add_subparsers(parser_class=parser_class)
    add_parser(sub)
    return sub.choices["train"]


def run_flags(args: argparse.Namespace) -> list[str]:
    """The run's flags in `args` that differ from their defaults, as a command line (what a
    detached run's coordinator is given)."""
    flags = []
    for action in train_parser()._actions:
        value = getattr(args, action.dest, action.default)
        if action.dest in AGENT_FLAGS or value is None or value == action.default:
            continue
        flag = next(s for s in action.option_strings if s.startswith("--"))
        if isinstance(value, list):  # --lr-drops
            value = ",".join(map(str, value)) or "none"
        flags += [flag] if action.nargs == 0 else [flag, str(value)]
    return flags


def lr_drops(text: str) -> list[int]:
    """`--lr-drops`: step numbers, comma-separated and increasing, or none."""
    if text.strip().lower() == "none":
        return []
    try:
        steps = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not step numbers like 800,900 (or none)") from None
    if any(v < 1 for v in steps) or steps != sorted(set(steps)):
        raise argparse.ArgumentTypeError(f"'{text}': give increasing step numbers of 1 or more (or none)")
    return steps


def preflight(args: argparse.Namespace) -> None:
    """The mistakes in the flags found without torch, which takes seconds to load here and more
    on a small device: files that are not there or cannot be what they are given as, a data
    folder that is not one, an image size the model does not take (in the words the run
    would say them in later)."""
    from swarm.data.yolo_dir import data_folder
    from swarm.local.files import check_checkpoint, check_weights
    from swarm.zoo import DEFAULT_MODEL, default_img_size, describe_model

    if args.resume and args.weights:
        raise SwarmError("--weights starts a new run; --resume continues one with its own weights: give one of them")
    if args.resume:
        check_checkpoint(args.resume)
    if args.weights:
        check_weights(args.weights)
    if args.data not in (None, "synthetic"):
        data_folder(args.data)
    if not args.resume:  # a resumed run's model and size are its checkpoint's
        model = args.model or DEFAULT_MODEL
        describe_model(model, default_img_size(model, args.img_size))


def training_config(args: argparse.Namespace):
    """The TrainConfig: defaults, then the resumed checkpoint's settings, then explicit flags
    (checked by preflight first)."""
    from swarm.local.trainer import TrainConfig

    cfg = TrainConfig()
    state = None
    if args.resume:
        from swarm.local.checkpoint import load_checkpoint

        state = load_checkpoint(args.resume)
        saved = state.get("config", {})
        saved = {"augment": False, "lr_drops": [], **saved}  # a run from before these trained without them
        cfg = TrainConfig(**{f.name: saved[f.name] for f in fields(TrainConfig) if f.name in saved})
        cfg.model = state["model_name"] if "model" not in saved else saved["model"]
        if args.model and args.model != cfg.model:
            raise SwarmError(f"--model {args.model} differs from the checkpoint's model {cfg.model}")
        if getattr(args, "anchors", None) and args.anchors != cfg.anchors:
            raise SwarmError(f"--anchors {args.anchors} differs from the checkpoint's {cfg.anchors}: a resumed run "
                             "keeps the anchors it started with")
        if args.img_size and args.img_size != state["img_size"]:
            raise SwarmError(f"--img-size {args.img_size.to_json()} differs from the checkpoint's "
                             f"{state['img_size'].to_json()}")
    for f in fields(TrainConfig):
        value = getattr(args, f.name, None)
        if f.name == "augment" and value is not None:
            value = value == "on"
        if value is not None:
            setattr(cfg, f.name, value)
    if not (args.strategy == "local" or (args.in_process and args.strategy == "tiles")):
        if args.accelerator:
            raise SwarmError("--accelerator applies to training on this machine (--strategy local, or tiles "
                             "--in-process)")
        cfg.accelerator = "cpu"  # a run across devices ships weights from this machine's copy: it stays on the host
    if args.steps is not None and args.epochs is not None:
        raise SwarmError("give --steps or --epochs, not both")
    if args.epochs is not None:
        cfg.steps = None
    return cfg, state


def check_microbatches(cfg, state: dict | None) -> None:
    """Refuse, before anything runs, micro-batches that a BatchNorm layer of the model cannot
    train on (one sample over a 1x1 map: one value per channel), whatever the strategy: a
    micro-batch reaches each BatchNorm whole (across a dp group, by shared statistics)."""
    from swarm.local.batchnorm_check import microbatch_refusal
    from swarm.zoo import default_img_size, describe_model

    cfg_text = state.get("cfg") if state else None  # a resumed run's model is its checkpoint's
    desc = describe_model(cfg.model, default_img_size(cfg.model, cfg.img_size), None, cfg_text)
    why = microbatch_refusal(desc, cfg.batch_size, cfg.microbatches)
    if why is not None:
        raise SwarmError(why)


def note_darknet_only(cfg, state: dict | None, log) -> None:
    """Say once which of a .cfg's options only steer darknet's own training loop (a built-in
    model's are swarm's own defaults, and go unsaid)."""
    from swarm.zoo import BUILTIN, darknet_only_options

    if cfg.model in BUILTIN and not state:
        return
    options = darknet_only_options(cfg.model, state.get("cfg") if state else None)
    if options:
        log(f"{Path(cfg.model).name}: darknet's own training options are not used (swarm's flags set the schedule "
            f"and batch): {', '.join(options)}")


def runner_for(args: argparse.Namespace, log):
    """(make_trainer, run_steps) for the chosen --strategy and flags."""
    from swarm.local.trainer import LocalTrainer, run_local_steps

    def given(*flags):
        return [flag for flag in flags if getattr(args, flag.lstrip("-").replace("-", "_"))]

    if args.strategy == "local":
        extra = given("--grid", "--sync", "--together", "--replicas", "--in-process", "--plan", "--devices",
                      "--stages")
        if extra:
            verb = "does" if len(extra) == 1 else "do"
            raise SwarmError(f"{' and '.join(extra)} {verb} not apply to --strategy local (it trains on this "
                             f"machine alone)")
        return LocalTrainer, run_local_steps
    if args.strategy not in ("tiles", "hybrid") and given("--grid", "--sync"):
        raise SwarmError(f"{' and '.join(given('--grid', '--sync'))} apply to --strategy tiles and hybrid only")
    if args.together and args.strategy not in ("tiles", "auto"):
        raise SwarmError("--together applies to --strategy tiles only")
    if args.replicas and args.strategy not in ("tiles", "dp"):
        raise SwarmError("--replicas applies to --strategy tiles and dp only")
    if args.stages and args.strategy != "pp":
        raise SwarmError("--stages applies to --strategy pp only")
    grid = None
    if args.grid:
        from tiles.grouping import parse_grid
        from tiles.regions import TilingError

        try:
            grid = parse_grid(args.grid)
        except TilingError as exc:
            raise SwarmError(str(exc)) from None
    if args.in_process:
        if args.together or args.replicas:
            raise SwarmError(f"{'--together' if args.together else '--replicas'} applies to tiles across devices, "
                             "not --in-process")
        if args.plan or args.strategy == "auto":
            raise SwarmError("--in-process needs a --strategy (tiles, dp, pp or hybrid)")
        if args.strategy == "tiles":
            if not grid:
                raise SwarmError("--strategy tiles --in-process needs --grid ROWSxCOLS, e.g. --grid 2x2")
            from swarm.local.tiled import tiled_trainer_factory

            return tiled_trainer_factory(args.grid, args.sync, log), run_local_steps
        from swarm.execution.inprocess import InProcessRunner

        return LocalTrainer, InProcessRunner(args.strategy, args.devices or 4, grid, args.sync, args.stages, log)
    from swarm.execution.launch import SwarmOptions, SwarmRunner

    options = SwarmOptions(strategy="plan" if args.plan else args.strategy, plan_path=args.plan, grid=grid,
                           sync=args.sync, stages=args.stages, devices=args.devices, together=args.together,
                           replicas=args.replicas,
                           wait_s=args.wait if args.wait is not None else (60.0 if args.devices else 2.0),
                           schedule=args.schedule, backup_interval=args.backup_every,
                           checkpoint_every=args.save_every if args.save_every else 25,
                           local_save_every=args.save_every, recovery=args.recovery, recost=args.recost == "on",
                           save_path=args.save or args.resume or f"swarm-{Path(args.model or 'yolov2-16').stem}.pt",
                           interface=args.interface, peers=args.peers, state_dir=args.state_dir,
                           token_file=args.token_file, run_id=args.run_id, take_over=args.take_over,
                           run_flags=run_flags(args) if args.run_id else [])
    return LocalTrainer, SwarmRunner(options, log, fallback=run_local_steps)


def run(args: argparse.Namespace) -> int:
    if args.coordinator and not args.detach:
        raise SwarmError("--coordinator chooses where a --detach'ed run is coordinated: add --detach")
    if args.detach:
        from swarm.commands.jobs_cmd import detach

        kept = [flag for flag, given in (("--save", args.save), ("--metrics", args.metrics)) if given]
        if kept:
            raise SwarmError(f"{' and '.join(kept)} would be written on the coordinating device: a detached run keeps "
                             f"its checkpoint and metrics there (`swarm fetch JOB` brings the checkpoint here)")
        return detach(args, run_flags(args))

    preflight(args)
    from swarm.local.trainer import SAVE_EVERY_S, train

    cfg, state = training_config(args)
    check_microbatches(cfg, state)
    save = args.save or args.resume or f"swarm-{Path(cfg.model).stem}.pt"
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    note_darknet_only(cfg, state, log)
    make_trainer, run_steps = runner_for(args, log)
    from swarm.execution.launch import SwarmRunner

    swarm_run = isinstance(run_steps, SwarmRunner)  # saves at intervals itself, with collected weights
    summary = train(cfg, state=state, save=save, metrics=args.metrics, threads=args.threads,
                    evaluate_at_end=not args.no_eval, save_every=0 if swarm_run else args.save_every,
                    save_every_s=0.0 if swarm_run else SAVE_EVERY_S, log=log,
                    make_trainer=make_trainer, run_steps=run_steps)
    first, last = summary["first_loss"], summary["last_loss"]
    parts = [f"trained {cfg.model} for {summary['steps']} steps"]
    if first is not None:
        parts[0] += f" in {format_seconds(summary['seconds'])} (loss {first:.3g} -> {last:.3g})"
    if summary["eval"] is not None:
        parts.append(str(summary["eval"]))
    parts.append(f"checkpoint: {summary['checkpoint']}")
    print("; ".join(parts))
    if summary.get("eval_error"):
        print(f"the held-out evaluation failed ({summary['eval_error']}); the trained model is saved all the same: "
              f"{summary['checkpoint']}", file=sys.stderr)
    if summary["interrupted"]:
        print(f"resume with: swarm train --resume {save}", file=sys.stderr)
        return 130
    return 0
