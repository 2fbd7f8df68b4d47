"""Every channel of a training job: the keys its devices and coordinator send each other
messages under, one constructor each, as wire/messages.py declares the protocol's messages.

A message is (key, payload) (see endpoint.py): the key is a tuple whose first element names
the channel, the rest says which one of its messages it is; the receiver waits for exactly
that key in its mailbox. Keys are built here and nowhere else.

Coordinator -> device (the step's data, its decision, the run's end):
    feed(step, part, m)                  {"arrays": [uint8 image block]} for a first-stage part
    targets(step, part, m)               {"arrays": [targets]} for a last-stage part
    decide(step)                         {"commit", "last", "checkpoint", "backup": bool}
    forget(step)                         {}: the backup at `step` is complete, drop older ones
    stop()                               {}: the run is over
Device -> coordinator:
    ready(step, device)                  {"loss", "busy_s", "times"}: its share of the step is done
    summed(step, device)                 {}: its sums and updates of a step are done (its link is free
                                         for the samples of the step after next)
    backup_ready(step, device)           {}: its snapshot and the backups it holds are in place
    state(step, stage, device)           {"states"}: a stage's weights and optimizer state (checkpoints)
    link(device, far_end)                {"reason"}: its connection to far_end broke (routed, not mailed)
Device -> device (the pipeline, and replay):
    act(step, stage, part, m, tensor, src)   {"arrays": [block]} of map `tensor` from part src of stage-1
    grad(step, stage, part, m, tensor, src)  {"arrays": [block]} of dL/d(map) from part src of stage+1
    layers(stage, src)                   {"states"}: layer states for a stage at the epoch's start (a move;
                                         src may be the coordinator)
    backup(step, stage, piece)           {"piece", "pieces"}: piece of another device's stage to hold
    bnstats(step, stage, replica)        {"records", "arrays"}: a replica's BatchNorm batch statistics
    halo(step, stage, sync, src, dst, rect)  {"arrays": [halo rectangle]} between tiles on two devices
Group operations (collectives.py) run under a group key, which they extend per round:
    group BatchNorm bn(step, stage, m, layer, tag), running statistics running(step, stage),
    gradients grads(step, stage), a tiles stage's channel sums tile_sums(step, stage, sync);
    gather(group_key, round, src) and ring(group_key, phase, k, src) carry their rounds.
"""
from __future__ import annotations

COORDINATOR = "coordinator"  # the coordinator's name among a job's endpoints

Key = tuple


# ---- coordinator -> device ------------------------------------------------------------
def feed(step: int, part: int, m: int) -> Key:
    return ("feed", step, part, m)


def targets(step: int, part: int, m: int) -> Key:
    return ("tgt", step, part, m)


def decide(step: int) -> Key:
    return ("decide", step)


def forget(step: int) -> Key:
    return ("forget", step)


def stop() -> Key:
    return ("stop",)


# ---- device -> coordinator ------------------------------------------------------------
def ready(step: int, device: str) -> Key:
    return ("ready", step, device)


def summed(step: int, device: str) -> Key:
    return ("summed", step, device)


def backup_ready(step: int, device: str) -> Key:
    return ("backup_ready", step, device)


def state(step: int, stage: int, device: str) -> Key:
    return ("state", step, stage, device)


LINK = "link"  # the channel the coordinator routes to its link watch instead of the mailbox


def link(device: str, far_end: str) -> Key:
    return (LINK, device, far_end)


# ---- device -> device -----------------------------------------------------------------
def act(step: int, stage: int, part: int, m: int, tensor: int, src: int) -> Key:
    return ("act", step, stage, part, m, tensor, src)


def grad(step: int, stage: int, part: int, m: int, tensor: int, src: int) -> Key:
    return ("grad", step, stage, part, m, tensor, src)


def layers(stage: int, src: str) -> Key:
    return ("layers", stage, src)


def backup(step: int, stage: int, piece: int) -> Key:
    return ("backup", step, stage, piece)


def bnstats(step: int, stage: int, replica: int) -> Key:
    return ("bnstats", step, stage, replica)


def halo(step: int, stage: int, sync: tuple, src: int, dst: int, rect: tuple[int, int, int, int]) -> Key:
    return ("halo", step, stage, *sync, src, dst, *rect)


# ---- group operations -----------------------------------------------------------------
def bn(step: int, stage: int, m: int, layer: str, tag: str) -> Key:
    return ("bn", step, stage, m, layer, tag)


def running(step: int, stage: int) -> Key:
    return ("running", step, stage)


def grads(step: int, stage: int) -> Key:
    return ("grads", step, stage)


def tile_sums(step: int, stage: int, sync: tuple) -> Key:
    return ("tsum", step, stage, *sync)


def gather(group_key: Key, round_: int, src: int) -> Key:
    return ("gather", *group_key, round_, src)


def ring(group_key: Key, phase: str, k: int, src: int) -> Key:
    return ("ring", *group_key, phase, k, src)


def send_priority(key: Key) -> tuple:
    """The order in which messages waiting for a connection go (links.RunLinks.send): a
    gradient share after anything else (the next forward and everything of this step's
    schedule need theirs now), those of earlier steps first, and of a step the shares of
    the front layers' buckets first (their updates gate the next forward first)."""
    if len(key) > 4 and key[0] == "ring" and key[1] == "grads":
        return (1, key[2], key[4])  # (step, bucket: named by its top layer)
    return (0,)
