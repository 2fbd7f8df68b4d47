"""Asteroid's stage costs for every layer range at once: Algorithm 1 vectorised over ranges.

For a group of devices (a block of the memory-sorted device list) and a warm-up K, every
layer range [i, j) gets the allocation of Alg. 1 (planner/allocation.py, the same steps in
the same order, on numpy arrays of ranges) and from it E_f, E_b (eq. 8) and whether the
group can hold the stage at all (eq. 3 on every device, weights included). Stages start
and end at candidate cuts (all layer boundaries for models up to a few dozen layers);
ranges are indexed by the flat position of (cut i, cut j) in a C x C array, entries with
j <= i unused.
"""
from __future__ import annotations

import numpy as np

from planner.inputs import PlanInputs
from planner.memory import OPTIMIZER_STATE_FLOATS, largest_share


class AsteroidTables:
    def __init__(self, inputs: PlanInputs, order: list[str], cuts: list[int] | None = None,
                 bound: float | None = None):
        self.inputs = inputs
        self.order = order
        cl, mem = inputs.cluster, inputs.mem
        L = self.L = inputs.num_layers
        self.cuts = np.array(cuts if cuts is not None else range(L + 1))
        C = len(self.cuts)
        self.B = inputs.microbatch
        self.block = max(1, self.B // 16)
        ii, jj = np.meshgrid(np.arange(C), np.arange(C), indexing="ij")
        self.valid = np.flatnonzero((jj > ii).ravel())
        self.vi, self.vj = self.cuts[ii.ravel()[self.valid]], self.cuts[jj.ravel()[self.valid]]
        ends_last = self.vj == L
        # per device d (position in `order`) and range r, at flat index d * ranges + r: forward
        # and backward times at each measured batch size (row k of grid), padded with zeros to
        # the longest grid (adding zeros changes no sum); per device and sample count y, at
        # d * (B + 1) + y: the interpolation weights of each grid size, and the loss's times
        devices = [cl.device(name).costs for name in order]
        grid = max(len(costs.batch_sizes) for costs in devices)
        D, n, Y = len(order), len(self.valid), self.B + 1
        f_all, b_all = np.zeros((grid, D, n)), np.zeros((grid, D, n))
        interp = np.zeros((grid, D, Y))  # time(y) = sum_k interp[k, d, y] * time at grid size k
        self.loss_f, self.loss_b, self.loss = np.zeros(D * Y), np.zeros(D * Y), np.zeros(D * Y)
        for d, costs in enumerate(devices):
            cf, cb = costs.cumulative("fwd"), costs.cumulative("bwd")
            k = len(costs.batch_sizes)
            f_all[:k, d] = (cf[self.vj] - cf[self.vi]).T
            b_all[:k, d] = (cb[self.vj] - cb[self.vi]).T
            for y in range(Y):
                k0, k1, w0, w1 = costs.weights(y)
                interp[k0, d, y] += w0
                interp[k1, d, y] += w1
                lf, lb = costs.loss_time(y)
                self.loss_f[d * Y + y], self.loss_b[d * Y + y], self.loss[d * Y + y] = lf, lb, sum((lf, lb))
        self.f_all, self.b_all = f_all.reshape(grid, D * n), b_all.reshape(grid, D * n)
        self.interp = interp.reshape(grid, D * Y)
        self.ends_last = ends_last
        self.budget = np.array([cl.device(n).memory for n in order], dtype=float)
        # memory per range (eq. 3 pieces)
        cum_p = np.concatenate([[0.0], np.cumsum(mem.param_bytes)])
        cum_a = np.concatenate([[0.0], np.cumsum(mem.act_bytes)])
        copies = 2 + OPTIMIZER_STATE_FLOATS[mem.optimizer]
        spans = cum_p[self.vj] - cum_p[self.vi]
        self.weights = copies * spans + mem.kept_charge(spans * mem.state_copies)  # MemoryModel.weights, every range
        self.act = mem.slack * (cum_a[self.vj] - cum_a[self.vi])
        self.grad_peak = mem.slack * mem.transient_table[self.vi, self.vj]
        self.param_bytes = cum_p[self.vj] - cum_p[self.vi]
        self.growth = mem.growth
        self.whole_reserve = np.array([mem.budget(i, j, 0.0) for i, j in zip(self.vi, self.vj)])  # MemoryModel.budget
        self._uncapped: dict = {}
        self._capped: dict = {}
        self.bound = bound  # a stage whose devices cannot compute it in less is not worked out (worth)
        if bound is not None:
            every = np.repeat(np.arange(D)[:, None], n, axis=1)
            rate = np.zeros((D, n))  # samples a second at each device's best time per sample on each range
            for y in range(1, self.B + 1):
                t = self.totals(every, np.full((D, n), y), np.arange(n))
                rate = np.maximum(rate, np.where(t > 0, y / np.where(t > 0, t, 1.0), np.inf))
            self.rate = rate.ravel()

    # ---- times -----------------------------------------------------------------------
    # `members` is a group per range: shape (g, n), row k the k-th member for each range of
    # `cols` (a list of g positions: the same group for every range)
    def _members(self, group, n: int) -> np.ndarray:
        members = np.asarray(group)
        return np.repeat(members[:, None], n, axis=1) if members.ndim == 1 else members

    def times(self, members: np.ndarray, y: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) of members[k, c] on y[k, c] samples of range cols[c], shape (g, n),
        with the same floating-point steps as CostTable.range_time (the added terms are zeros)."""
        at_y = members * (self.B + 1) + y
        at_range = members * len(self.valid) + cols[None, :]
        weights = [w.take(at_y) for w in self.interp]
        out = []
        for tab in (self.f_all, self.b_all):
            acc = weights[0] * tab[0].take(at_range)
            for k in range(1, len(tab)):
                acc = acc + weights[k] * tab[k].take(at_range)
            out.append(np.maximum(0.0, acc))
        return out[0], out[1]

    def totals(self, members: np.ndarray, y: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Forward plus backward (and the loss on the last stage) of each member, shape (g, n)."""
        f, b = self.times(members, y, cols)
        t = f + b
        last = self.ends_last[cols][None, :] & (y > 0)
        t = np.where(last, t + self.loss.take(members * (self.B + 1) + y), t)
        return np.where(y > 0, t, 0.0)

    def caps(self, group, K: int, cols: np.ndarray) -> np.ndarray:
        """Most samples each member can hold (MemoryModel.max_batch), shape (g, n); -1 where
        even the weights do not fit. `group`: positions, or members per range."""
        members = self._members(group, len(cols))
        free = self.budget[members] + self.whole_reserve[cols][None, :] - self.weights[cols][None, :]
        per = K * self.act[cols] + self.grad_peak[cols]
        return largest_share(free, np.broadcast_to(per[None, :], free.shape), self.growth).astype(np.int64)

    # ---- Alg. 1 ------------------------------------------------------------------------
    def allocate(self, group, cols: np.ndarray, caps: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """Alg. 1 for every range in `cols`: (y of shape (g, n), feasible of shape (n,)).
        `group`: positions, or members per range."""
        members = self._members(group, len(cols))
        g, n, B = members.shape[0], len(cols), self.B
        if caps is None:
            caps = np.full((g, n), B, dtype=np.int64)
        caps_ok = np.maximum(caps, 0)
        feasible = caps_ok.sum(axis=0) >= B
        speed = 1.0 / np.maximum(self.totals(members, np.full((g, n), B), cols), 1e-12)
        y = np.zeros((g, n), dtype=np.int64)
        left = np.where(feasible, B, 0)
        active = caps_ok > 0
        rows = np.arange(g)[:, None]
        while (left > 0).any():
            w = np.where(active, speed, 0.0)
            s = w.sum(axis=0)
            with np.errstate(invalid="ignore", divide="ignore"):
                exact = np.where(s > 0, left * w / np.where(s > 0, s, 1.0), 0.0)
            fl = np.floor(exact).astype(np.int64)
            fl = np.where(active, fl, 0)
            rem = left - fl.sum(axis=0)
            frac = np.where(active, exact - fl, -1.0)
            order = np.argsort(-frac, axis=0, kind="stable")
            rank = np.empty_like(order)
            np.put_along_axis(rank, order, rows.repeat(n, axis=1), axis=0)
            shares = fl + ((rank < rem[None, :]) & active)
            take = np.minimum(shares, caps_ok - y)
            take = np.where(left[None, :] > 0, take, 0)
            y += take
            given = take.sum(axis=0)
            left = left - given
            active = active & (y < caps_ok)
            stuck = (left > 0) & (given == 0)
            if stuck.any():
                best = np.argmax(np.where(active, speed, -np.inf), axis=0)
                c = np.flatnonzero(stuck)
                y[best[c], c] += 1
                left[c] -= 1
        # Phase 2: straggler offloading
        live = np.flatnonzero(feasible & (g > 1))
        t_all = None
        for _ in range(B * g + 1):
            if live.size == 0:
                break
            cl = cols[live]
            ml = members[:, live]
            yl = y[:, live]
            t = self.totals(ml, yl, cl) if t_all is None else t_all
            slow = np.argmax(t, axis=0)
            idx = np.arange(live.size)
            move = np.minimum(self.block, yl[slow, idx])
            plus = np.minimum(yl + move[None, :], B)  # (capped at B only where there is no room anyway)
            room = (yl + move[None, :] <= caps_ok[:, live]) & (np.arange(g)[:, None] != slow[None, :])
            t_plus = self.totals(ml, plus, cl)
            t_plus = np.where(room, t_plus, np.inf)
            fast = np.argmin(t_plus, axis=0)
            has_room = room.any(axis=0) & (move > 0)
            trial = yl.copy()
            trial[slow, idx] -= move
            trial[fast, idx] += np.where(has_room, move, 0)
            trial[slow, idx] += np.where(has_room, 0, move)
            minus = np.maximum(yl - move[None, :], 0)
            t_minus = self.totals(ml, minus, cl)
            t_new = t.copy()
            t_new[slow, idx] = np.where(has_room, t_minus[slow, idx], t[slow, idx])
            t_new[fast, idx] = np.where(has_room, t_plus[fast, idx], t_new[fast, idx])
            accept = has_room & (t_new.max(axis=0) < t[slow, idx] - 1e-15)
            y[:, live[accept]] = trial[:, accept]
            live = live[accept]
            t_all = t_new[:, accept]
        return y, feasible

    def stage(self, group: list[int], K: int) -> tuple[np.ndarray, np.ndarray]:
        """(E_f, E_b) over all ranges for the group at warm-up K (inf where it cannot fit)."""
        return self.stages([group], K)[0]

    def stages(self, groups: list[list[int]], K: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """stage() of several groups of one size, worked out together: each group's ranges
        are columns of one Alg. 1 over all of them (but those not worth it: inf)."""
        todo = list(dict.fromkeys(tuple(g) for g in groups if (tuple(g), K) not in self._capped))
        if todo:
            n = len(self.valid)
            members, cols = self._columns(todo)
            worth = self.worth(members, cols)
            fresh = [k for k, g in enumerate(todo) if g not in self._uncapped]
            if fresh:
                at = np.concatenate([np.arange(k * n, (k + 1) * n) for k in fresh])
                at = at[worth[at]]
                ef, eb = np.full(len(cols), np.inf), np.full(len(cols), np.inf)
                y, _ = self.allocate(members[:, at], cols[at], None)
                ef[at], eb[at] = self._eval(members[:, at], y, cols[at])
                for k in fresh:
                    self._uncapped[todo[k]] = (ef[k * n:(k + 1) * n], eb[k * n:(k + 1) * n])
            caps = self.caps(members, K, cols)
            binding = (caps < self.B).any(axis=0) & worth
            ef = np.concatenate([self._uncapped[g][0] for g in todo])
            eb = np.concatenate([self._uncapped[g][1] for g in todo])
            if binding.any():
                bc = np.flatnonzero(binding)
                y, feasible = self.allocate(members[:, bc], cols[bc], caps[:, bc])
                feasible &= (caps[:, bc] >= 0).all(axis=0)  # every member holds the stage's weights
                f2, b2 = self._eval(members[:, bc], y, cols[bc])
                ef[bc] = np.where(feasible, f2, np.inf)
                eb[bc] = np.where(feasible, b2, np.inf)
            for k, g in enumerate(todo):
                self._capped[(g, K)] = (ef[k * n:(k + 1) * n], eb[k * n:(k + 1) * n])
        return [self._capped[(tuple(g), K)] for g in groups]

    def worth(self, members: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """Which ranges each group could compute in less than `bound` a step: its M
        micro-batches at the group's summed rate (each member at its best time per sample)
        take at least that long, and every plan with the stage at least as long
        (planner/bounds.py). All, without a bound."""
        if self.bound is None:
            return np.ones(len(cols), dtype=bool)
        rate = self.rate.take(members * len(self.valid) + cols[None, :]).sum(axis=0)
        return self.inputs.microbatches * self.B < self.bound * rate

    def _columns(self, groups: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray]:
        """Every range of every group as one column: (members (g, len(groups) * n), cols)."""
        n = len(self.valid)
        members = np.repeat(np.array(groups, dtype=np.int64).T, n, axis=1)
        return members, np.tile(np.arange(n), len(groups))

    def _eval(self, members: np.ndarray, y: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Eq. 8: the slowest member's forward and backward (loss included on the last stage)."""
        f, b = self.times(members, y, cols)
        has = y > 0
        last = self.ends_last[cols][None, :] & has
        f = np.where(has, f, 0.0)
        b = np.where(has, b, 0.0)
        at_y = members * (self.B + 1) + y
        f = np.where(last, f + self.loss_f.take(at_y), f)
        b = np.where(last, b + self.loss_b.take(at_y), b)
        return np.maximum(0.0, f.max(axis=0)), np.maximum(0.0, b.max(axis=0))

    def allocation_of(self, group: list[int], K: int, first: int, last: int) -> dict[str, int] | None:
        """The Alg. 1 allocation of one range (for building the final plan)."""
        col = np.flatnonzero((self.vi == first) & (self.vj == last))
        caps = self.caps(group, K, col)
        y, feasible = self.allocate(group, col, caps)
        if not (feasible[0] and (caps[:, 0] >= 0).all()):
            return None
        return {self.order[d]: int(y[k, 0]) for k, d in enumerate(group)}
