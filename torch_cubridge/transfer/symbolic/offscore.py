"""Values off the score path that no rule covers: the walk leaves them to PyTorch (the prologue).

A mixin of the graph walker (graph.Walker): when a rule refuses a node, its computed inputs or the node
itself become prologue tensors (transfer/prologue.py records the spec's own ops, ir/prologue.py replays
them per call); values whose exact bits only PyTorch's arithmetic gives (float maths rounded to integers,
gathers through data) go there even when a rule exists.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.fx import Node

from ...errors import HeldTensorRefused, UnsupportedSpec
from ...ir.expr import Expr, const, load, loads, walk
from .contract import packs_axes
from ..prologue import cone_of
from .distance import distance_chain, index_of
from .sym import Sym, input_sym, packet_name


class OffScorePath:
    """What graph.Walker provides: ctx, env, prologue, on_score, from_call, not_score, split_inputs and call()."""

    def recover(self, node: Node) -> Sym | None:
        """After a rule refused `node`: retry it with its computed inputs that are off the score
        path made into prologue tensors; else, if `node` itself is off the score path, make it one.
        None: neither applies."""
        if self.prologue is None:
            return None
        ins = [a for a in node.all_input_nodes if self._computed(a)]
        if ins:
            saved = dict(self.env)
            try:
                for a in ins:
                    # views above a computed value (matmul's expand and reshape to [B*H, S, D]) are walked
                    # again from it, so the made tensor keeps the spec's own dims
                    chain = [a]
                    while _view_op(chain[-1]) and self._computed(chain[-1].args[0]):
                        chain.append(chain[-1].args[0])
                    self.env[chain[-1]] = self._materialize_keeping_merges(chain[-1])
                    for n in reversed(chain[:-1]):
                        self.env[n] = self.call(n)
                return self.call(node)
            except UnsupportedSpec:
                self.env = saved
        off = all(self._off_score(a) for a in node.all_input_nodes) and node not in self.on_score \
            and not self._attention_op(node)
        val = node.meta.get("val")
        if off and isinstance(val, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in val):
            return PENDING  # several results (var_mean, a fused norm): each taken is made on its own
        if off and isinstance(val, torch.Tensor):
            try:
                return self.materialize(node)
            except UnsupportedSpec:
                return None
        return None

    def settle(self, node: Node, val: Any) -> Any:
        """Values off the score path whose exact bits only PyTorch's own arithmetic gives: an integer
        or boolean made from float maths that rounds (T5's log buckets: log(2)/log(16)*8 is 2 in
        float32 and 1.999.. in float64, so the bucket differs), and a gather through indices read
        from data (its reads have no static bound; the gathered values have). Both go to the prologue."""
        if self.prologue is None or not isinstance(val, Sym) or val.kind != "value" or val.expr is None \
                or not self._off_score(node) or any(a in self.on_score for a in node.all_input_nodes):
            return val
        rounds = not val.dtype.is_floating_point and _rounding_float(val.expr)
        if rounds or _gathers(val.expr) and not self._pairwise(node, val):
            return self.materialize(node)
        return val

    def _pairwise(self, node: Node, val: Sym) -> bool:
        """A gather whose result spans a query-length axis and a key-length one (`table[tq[:, :, None],
        tk[:, None, :]]`): the kernel reads it through the ids (bounds.py clamps the reads), where the
        prologue would build and the kernel read a [.., Sq, Skv] tensor per call. Lengths under 16 (a
        probe's) or not known yet (the gather comes before q.k) leave it to the prologue."""
        lens = {self.ctx.sizes[a] for a, r in self.ctx.roles.items() if r in ("q", "kv")}
        if not lens or min(lens) < 16:
            return False
        long_axes = [d for d in val.axes if self.ctx.dim_size(d) in lens]
        # a function of kv - q alone (T5's buckets) has its compact table over the distances instead
        return len(long_axes) >= 2 and distance_chain(node, cone_of(node), self.env) is None

    def _computed(self, n: Any) -> bool:
        """n is a node off the score path whose value is an expression, not a plain tensor read."""
        return isinstance(n, Node) and self._off_score(n) and isinstance(self.env.get(n), Sym) \
            and self.env[n].expr is not None and self.env[n].expr.op != "load"

    def _off_score(self, n: Node) -> bool:
        return n not in self.on_score and isinstance(n.meta.get("val"), torch.Tensor)

    def _attention_op(self, n: Node) -> bool:
        """q.k, softmax or P.v itself: never the prologue's (a refusal there must stand)."""
        name = packet_name(n)
        return name in ("_softmax", "softmax", "_safe_softmax", "_log_softmax", "logsumexp") or self.may_be_score(n)

    def may_be_score(self, n: Node) -> bool:
        """n is a matmul of two values read from the call (a matmul of positions by weights is an MLP)
        that no earlier walk took for q.k and failed with."""
        name = packet_name(n)
        if name not in ("bmm", "mm", "matmul", "baddbmm", "addmm") or n.name in self.not_score:
            return False
        pair = _operands(n)
        if not all(isinstance(x, Node) for x in pair):
            return False
        # a second walk lets one side be a tensor the function holds itself (a module's latent query)
        return all(x in self.from_call for x in pair) or (self.held_operand and any(x in self.from_call for x in pair))

    def make_held_operand(self, n: Node) -> None:
        """The side of q.k the function holds (a module's latent query), made by the prologue like a
        computed q, at its last shape before bmm's merge of batch and heads: the walk then meets the
        same 4-D value it meets for an argument."""
        for x in _operands(n):
            if x in self.from_call:
                continue
            chain = _to_merge(x)
            if not self.prologue.reads_arguments_only(chain[-1]):
                # a tensor baked into the program would serve stale values (and drop its gradient)
                # once the module's parameter changes: read it per call through an argument instead
                raise HeldTensorRefused("a side of q.k is a tensor the function holds outside its arguments "
                                        "(a bound method's parameter?); pass the module as an argument", op="matmul")
            self._make_at(chain)

    def _make_at(self, chain: list[Node]) -> None:
        """The top of `chain` made by the prologue, the views below it walked again from there."""
        self.env[chain[-1]] = self._materialize_keeping_merges(chain[-1])
        for m in reversed(chain[:-1]):
            self.env[m] = self.call(m)

    def make_gathered_operands(self, node: Node) -> None:
        """Before q.k or P.v: an operand whose dims merge what a gather through data made (K/V pages read
        through a block table, pages x page size as one key dim) is made by the prologue at its last
        shape before the matmul merges dims, so the keys reach the matmul as one axis. Every other
        operand (an argument, a computed q, a head map through data) is left as it is."""
        made_here = set(self.ctx.facts.get("prologue", {}))
        for x in _operands(node):
            if not isinstance(x, Node) or x in self.on_score:
                continue
            chain = _to_merge(x)
            sym = self.env.get(chain[-1])
            if not isinstance(sym, Sym) or sym.kind != "value" or sym.expr is None:
                continue
            # pages x page size as one key dim: a merged axis whose every digit the value reads (a head
            # axis repeated for GQA, (kv head, group) with the group broadcast, reads one digit only)
            used = {n.attr for n in walk(sym.expr) if n.op == "var"}
            merged = any(len(ax) > 1 and all(a in used for a in ax) for ax in sym.axes)
            # a unit dim (() : the batch at B 1, merged with the heads by the matmul's view) counts too, as
            # (b, h) does at B > 1 after the view; but not for a value repeated over a group (GQA's
            # repeat_kv): made here it would be read at the query's heads while the key reads its group
            repeated = any(len(ax) > 1 and not all(a in used for a in ax) for ax in sym.axes)
            merged = merged or (any(len(ax) == 0 for ax in sym.axes) and not repeated)
            # a made tensor read with its own dims (permuted, unit dims added, batch and heads merged for bmm) names
            # every dim the operand needs: made again at the matmul's shape it would merge batch and heads into one
            # dim, or carry a unit dim (einsum's), that no operand layout names
            merged = merged and not _names_its_dims(sym, self.env.get(x))
            # a prologue tensor the operand reads with dims packed (nn.MultiheadAttention's in-projection,
            # [S, B, 3 * E], read as [B * H, S, D] through views): a refused walk named it (symbolic_transfer's
            # split retry), and the operand is made at its last shape instead, with the spec's own dims
            split = loads(sym.expr) & made_here & self.split_inputs
            if split or merged and (_gathers(sym.expr) or loads(sym.expr) & made_here):
                self._make_at(chain)
                # the value made here may itself be the tensor a refused walk named (made only now, at the
                # matmul, it was an expression of earlier steps when the walk passed its views)
                split = split or loads(self.env[chain[-1]].expr) & self.split_inputs
            if split and packed_read(self.env.get(x)):
                # the spec never shapes the operand with its batch and heads apart (the module's explicit
                # path: [B*H, S, D] views only): made as it reaches the matmul, its merged dims unflattened
                self.env[x] = self.materialize_unflattened(x, self.env[x])

    def _materialize_keeping_merges(self, node: Node) -> Sym:
        """materialize(node); a value with merged axes that reads a tensor with two axes packed in one dim is
        made with its merged axes kept apart (materialize_unflattened): a [B*H, S, D] q made from a packed
        projection ([B*N, H*D], split by the spec) stays batch by heads, as the other operands are made."""
        sym = self.env.get(node)
        unflat = set(self.ctx.facts.get("unflattened", ()))
        if isinstance(sym, Sym) and sym.expr is not None and sym.expr.op == "load" and sym.expr.attr in unflat:
            return sym  # made so already: made again it would lose its merged axes
        reads_unflat = isinstance(sym, Sym) and sym.expr is not None and loads(sym.expr) & unflat
        if (packed_read(sym) or reads_unflat) and any(len(ax) > 1 for ax in sym.axes):
            # a function of a tensor made unflattened (the split query scaled) keeps its axes apart too
            return self.materialize_unflattened(node, sym)
        if isinstance(sym, Sym) and sym.expr is not None and len(sym.axes) > 4 \
                and any(len(ax) == 0 for ax in sym.axes):
            # past rank 4, a unit dim no index reads (einsum's, unsqueezed before its bmm): made without it, as
            # no operand layout names it (at rank 4 a unit dim is an axis of size 1: the query when decoding)
            return self.materialize_unflattened(node, sym)
        return self.materialize(node)

    def materialize_unflattened(self, node: Node, sym: Sym) -> Sym:
        """`node` made by the prologue and viewed with every merged axis of `sym` (its value in the walk)
        unflattened into its atoms' sizes ([B*H, S, D] as [B, H, S, D]), read back as `sym`'s axes: the
        operand then reaches the matmul with one index per dim."""
        assert self.prologue is not None
        # a unit dim with no atom (einsum's) is viewed away: `sym` keeps it as an axis no index reads
        shape = [self.ctx.sizes[a] for ax in sym.axes for a in ax]
        step = self.prologue.record_view(node, tuple(shape))
        name = f"pro_{step}"
        val = node.meta["val"]
        t = torch.empty(shape, dtype=val.dtype, device="meta")
        flat = input_sym(self.ctx, name, t)
        self.ctx.facts.setdefault("prologue", {})[name] = step
        self.ctx.facts.setdefault("unflattened", set()).add(name)
        atoms, i = [], 0
        for ax in sym.axes:  # regroup the fresh atoms as `sym` groups its own (a size-1 one has none)
            atoms.append(tuple(a for fresh in flat.axes[i:i + len(ax)] for a in fresh))
            i += len(ax)
        return Sym(tuple(atoms), flat.expr, val.dtype)

    def materialize(self, node: Node) -> Sym:
        """`node` as a tensor the prologue makes: a load like any input's; a function of kv - q alone as
        a table over the distances (symbolic/distance.py)."""
        assert self.prologue is not None
        by_distance = self._by_distance(node)
        if by_distance is not None:
            return by_distance
        step = self.prologue.record(node)
        val = node.meta["val"]
        name = f"pro_{step}"
        sym = input_sym(self.ctx, name, torch.empty(val.shape, dtype=val.dtype, device="meta"))
        self.ctx.facts.setdefault("prologue", {})[name] = step
        return sym

    def _by_distance(self, node: Node) -> Sym | None:
        """`node` as a table over the Sq + Skv - 1 distances, where it is a function of kv - q alone."""
        found = distance_chain(node, cone_of(node), self.env)
        if found is None:
            return None
        diff, sign, chain = found
        d = self.env[diff]
        sq, skv = (self.ctx.dim_size(a) for a in d.axes)
        step = self.prologue.record_by_distance(diff, sign, chain, sq, skv)
        val = node.meta["val"]
        name = f"pro_{step}"
        self.ctx.facts.setdefault("inputs", {})[name] = torch.empty((1, sq + skv - 1, *val.shape[2:]),
                                                                    dtype=val.dtype, device="meta")
        self.ctx.facts.setdefault("prologue", {})[name] = step
        rest = tuple((self.ctx.atom(n),) for n in val.shape[2:])
        expr = load(name, const(0), index_of(d, sq), *(Expr("var", (), a[0]) for a in rest))
        return Sym(d.axes + rest, expr, val.dtype)


class _Pending:
    """An op with several results the prologue computes; getitem makes the one taken."""


PENDING = _Pending()


_VIEWS = {"view", "reshape", "_unsafe_view", "expand", "permute", "transpose", "t", "unsqueeze", "squeeze",
          "clone", "contiguous", "alias", "slice", "select"}


def _operands(n: Node) -> tuple:
    """The two factors of a matmul node (addmm's and baddbmm's first argument is the bias)."""
    name = packet_name(n)
    return tuple(n.args[1:3] if name in ("baddbmm", "addmm") else n.args[:2])


def _gathers(e: Expr) -> bool:
    """e reads a tensor at an index read from another (a gather through data)."""
    return any(n.op == "load" and any(m.op == "load" for a in n.args for m in walk(a)) for n in walk(e))


def _to_merge(x: Node) -> list[Node]:
    """x and the views above it that merge or split dims (bmm's [B*H, S, D]), up to the last value the
    spec itself shaped: the chain, that value last. Transposes between x and a merge are climbed too
    (a key folded to [B*H, S, D] and then transposed for q @ k^T); with no merge above them, x alone."""
    chain = [x]
    while _view_op(chain[-1]) and not merges_dims(chain[-1]) and _made(chain[-1].args[0]):
        chain.append(chain[-1].args[0])
    if not (_view_op(chain[-1]) and merges_dims(chain[-1])):
        return [x]
    while _view_op(chain[-1]) and merges_dims(chain[-1]) and _made(chain[-1].args[0]):
        chain.append(chain[-1].args[0])
    if packet_name(chain[-1]) == "expand" and _made(chain[-1].args[0]):
        chain.append(chain[-1].args[0])  # a broadcast over heads (MQA's one K head): the head map reads it
    return chain


def packed_read(v: Any) -> bool:
    """v reads a tensor with two axes packed in one dim (contract.packs_axes)."""
    return isinstance(v, Sym) and v.expr is not None and any(packs_axes(n) for n in walk(v.expr) if n.op == "load")


def _names_its_dims(top: Sym, operand: Any) -> bool:
    """`top` reads one tensor with a bare atom per index (0 for a unit dim), and the matmul's `operand` has
    its two contracted axes (rows, then columns or the reduction) as one atom each: only its batch axes merge."""
    e = top.expr
    if e is None or e.op != "load" or not all(a.op == "var" or a == const(0) for a in e.args):
        return False
    if sorted(a.attr for a in e.args if a.op == "var") != sorted(a for ax in top.axes for a in ax):
        return False
    return isinstance(operand, Sym) and len(operand.axes) >= 2 and all(len(ax) <= 1 for ax in operand.axes[-2:])


def _made(a: Any) -> bool:
    return isinstance(a, Node) and a.op == "call_function"


def merges_dims(n: Node) -> bool:
    """A view that may merge or split dims (the rest keep each dim's identity)."""
    return packet_name(n) in ("view", "reshape", "_unsafe_view")


def _view_op(n: Node) -> bool:
    name = packet_name(n)
    return n.op == "call_function" and name in _VIEWS and bool(n.args)


_INEXACT = {"tanh", "exp", "log", "sqrt", "rsqrt", "sigmoid", "sin", "cos", "exp2", "log2", "log1p", "expm1",
            "reciprocal", "div", "pow"}


def _rounding_float(e: Expr) -> bool:
    """e leaves float maths that can round (log, division, ...) through a cast, a floor or a comparison."""
    def inexact(x: Expr) -> bool:
        return any(n.op in _INEXACT for n in walk(x))
    for n in walk(e):
        if n.op in ("to_int", "to_bool", "floor") and inexact(n.args[0]):
            return True
        if n.op in ("eq", "ne", "lt", "le", "gt", "ge") and any(inexact(a) for a in n.args):
            return True
    return False


