"""What autograd keeps for each layer's backward, in bytes per sample, as measured.

The planner's memory model takes these over its shape-based estimate."""
from __future__ import annotations


def saved_bytes(net, desc, outs, batch: int, layers=None) -> list[float]:
    """Bytes each layer (of `layers`, default all) keeps for the backward, per sample (saved
    tensors, each storage once, charged to the first layer that keeps it; parameters
    excluded, and a layer's input when the layer that made it keeps it already as its
    activation's result). `outs`: every map those layers read."""
    import torch

    from planner.memory import input_kept_upstream

    params = {p.untyped_storage().data_ptr() for p in net.parameters()}
    upstream = input_kept_upstream(desc)
    keys = list(range(batch))
    saved = []
    for i in range(len(desc.layers)) if layers is None else layers:
        seen: dict[int, int] = {}
        inputs = {s: outs[s] if s < 0 else outs[s].detach().requires_grad_(True) for s in desc.live_after(i)}
        skip = set(params)
        if i in upstream:
            skip.update(inputs[s].untyped_storage().data_ptr() for s in desc.layers[i].inputs)

        def pack(t):
            key = t.untyped_storage().data_ptr()
            if key not in skip and key not in seen:
                seen[key] = t.untyped_storage().nbytes()
            # detached: a layer that saves its own output (an in-place activation's result)
            # would otherwise hold its graph in a cycle through autograd's nodes, which
            # Python's collector cannot see, and every layer's activations would stay alive
            return t.detach()

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            net.forward_range(i, i + 1, inputs, keys)
        saved.append(sum(seen.values()) / batch)
    return saved
