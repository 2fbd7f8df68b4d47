"""The tile generators driven from outside: devices in threads exchanging messages equal the lockstep driver.

`run_devices` is the shape of a distributed driver: each device owns some tiles, steps
them in its own thread, answers collectives between its own tiles in memory and sends
everything else as messages (here queues instead of sockets), keyed by request key and
tile, with sizes known from the StageLayout beforehand.
"""
from __future__ import annotations

import copy
import queue
import threading

import pytest
import torch

from swarm.zoo import build_model
from tests.tiles_reference import rel_diff
from tiles.driver import run_lockstep
from tiles.executor import TileWorker
from tiles.grouping import Grouping
from tiles.layout import build_layout
from tiles.ops import crop
from tiles.regions import LayerGeometry, Rect
from tiles.requests import ChannelSums, HaloExchange


def run_devices(gens: dict[int, object], devices: list[list[int]]) -> dict[int, object]:
    """Run tile generators, device d stepping tiles devices[d] in its own thread."""
    device_of = {k: d for d, tiles in enumerate(devices) for k in tiles}
    inbox = [queue.Queue() for _ in devices]
    results, errors = {}, []

    def device(d: int) -> None:
        mine = devices[d]
        pending = {}  # messages that arrived early: (key, kind, src, dst, rect) -> payload

        def receive(key, kind, src, dst, rect=None):
            while (key, kind, src, dst, rect) not in pending:
                *address, payload = inbox[d].get(timeout=30)
                pending[tuple(address)] = payload
            return pending.pop((key, kind, src, dst, rect))

        try:
            answers = {k: None for k in mine}
            live = list(mine)
            while live:
                requests = {}
                for k in live:
                    try:
                        requests[k] = gens[k].send(answers[k])
                    except StopIteration as stop:
                        results[k] = stop.value
                live = sorted(requests)
                if not requests:
                    break
                key = next(iter(requests.values())).key
                assert all(r.key == key for r in requests.values())
                if isinstance(requests[live[0]], ChannelSums):
                    local = sum((requests[k].values for k in live[1:]), requests[live[0]].values.clone())
                    for other in range(len(devices)):
                        if other != d:
                            inbox[other].put((key, "sums", d, other, None, local.clone()))
                    parts = {d: local} | {o: receive(key, "sums", o, d) for o in range(len(devices)) if o != d}
                    total = sum((parts[o] for o in range(1, len(devices))), parts[0].clone())
                    answers = {k: total for k in live}
                else:
                    local_mail = {}
                    for k in live:
                        for dst, rect, tensor in requests[k].sends:
                            if device_of[dst] == d:
                                local_mail[(k, dst, rect)] = tensor
                            else:  # a copy, as a socket would make
                                inbox[device_of[dst]].put((key, "halo", k, dst, rect, tensor.contiguous().clone()))
                    answers = {}
                    for k in live:
                        got = []
                        for src, rect in requests[k].receives:
                            if device_of[src] == d:
                                got.append(local_mail.pop((src, k, rect)))
                            else:
                                tensor = receive(key, "halo", src, k, rect)
                                assert tuple(tensor.shape[2:]) == rect.shape
                                got.append(tensor)
                        answers[k] = got
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            errors.append(exc)

    threads = [threading.Thread(target=device, args=(d,)) for d in range(len(devices))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("grid,devices", [((2, 2), [[0, 3], [1, 2]]), ((2, 3), [[0], [1, 2], [3, 4, 5]])])
def test_devices_in_threads_equal_lockstep(grid, devices):
    torch.set_num_threads(1)
    net, desc, _ = build_model("yolov2-16", 48, classes=5, seed=3)
    net = net.double().train()
    geoms = [LayerGeometry.from_desc(d) for d in desc.layers[:12]]
    layout = build_layout(geoms, grid, Grouping.make(0, 12, [0, 4, 8], [2, 8, 12]), input_delta=True)
    x = torch.rand(2, 3, 48, 48, dtype=torch.float64)
    dy = torch.randn(2, *layout.map_shape(12), dtype=torch.float64)
    out_map = Rect.of(0, 6, 0, 6)
    whole = Rect.of(0, 48, 0, 48)

    def run(driver, modules):
        # one copy of the modules per device, as on real devices; the first tile of each keeps BN statistics
        owners = {k: d for d, tiles in enumerate(devices) for k in tiles}
        copies = [copy.deepcopy(modules) for _ in devices]
        lock = [threading.Lock() for _ in devices]
        workers = {k: TileWorker(layout, k, copies[owners[k]], keeps_running_stats=k == devices[owners[k]][0],
                                 grad_lock=lock[owners[k]]) for k in range(layout.n_tiles)}
        outs = driver({k: w.forward(7, crop(x, whole, layout.input_rect(k))) for k, w in workers.items()})
        dxs = driver({k: w.backward(7, crop(dy, out_map, layout.output_rect(k))) for k, w in workers.items()})
        grads = [sum(p.grad for p in ps) for ps in zip(*[[p for p in c.parameters()] for c in copies])]
        return outs, dxs, grads, copies[0].state_dict()

    lockstep = lambda gens: dict(enumerate(run_lockstep([gens[k] for k in sorted(gens)])))  # noqa: E731
    a = run(lockstep, net.layers[:12])
    b = run(lambda gens: run_devices(gens, devices), net.layers[:12])
    for k in range(layout.n_tiles):
        assert rel_diff(b[0][k], a[0][k]) < 1e-12 and rel_diff(b[1][k], a[1][k]) < 1e-12
    # each device holds partial gradients; their sum over devices is the full gradient either way
    assert all(rel_diff(gb, ga) < 1e-12 for gb, ga in zip(b[2], a[2]))
    assert all(torch.equal(b[3][k], a[3][k]) or rel_diff(b[3][k], a[3][k]) < 1e-12 for k in a[3])


def test_requests_are_the_same_sequence_on_every_tile_and_match_the_layout():
    torch.set_num_threads(1)
    net, desc, _ = build_model("yolov2-16", 48, classes=5, seed=3)
    geoms = [LayerGeometry.from_desc(d) for d in desc.layers]
    layout = build_layout(geoms, (2, 2), Grouping.parse("0,4,8", 0, 17), input_delta=False)
    workers = [TileWorker(layout, k, list(net.layers), keeps_running_stats=k == 0) for k in range(4)]
    x = torch.rand(1, 3, 48, 48)
    seen = {k: [] for k in range(4)}

    def recording(k, gen):
        answer = None
        while True:
            try:
                req = gen.send(answer)
            except StopIteration as stop:
                return stop.value
            seen[k].append(req.key)
            if isinstance(req, HaloExchange):
                assert [(d, r) for d, r, _ in req.sends] == [(t.dst, t.rect) for t in
                                                            layout.transfers_from(req.phase, req.boundary, k)]
                assert all(tuple(t.shape[2:]) == r.shape for _, r, t in req.sends)
            answer = yield req

    whole = Rect.of(0, 48, 0, 48)
    outs = run_lockstep([recording(k, w.forward(0, crop(x, whole, layout.input_rect(k)))) for k, w in enumerate(workers)])
    run_lockstep([recording(k, w.backward(0, torch.ones_like(o))) for k, (w, o) in enumerate(zip(workers, outs))])
    assert all(seen[k] == seen[0] for k in seen)
    kinds = [key[0] for key in seen[0]]
    assert sorted(layout.selection_transfers) == [4, 8, 12]  # pools 3, 7, 11 route windows their tiles do not own
    assert kinds.count("halo") == 2 + 3 + 3  # forward syncs 4, 8; backward syncs 4, 8, 17; three selections
    assert kinds.count("sums") == 2 * 12  # every BN layer, forward and backward
