"""Random schedules: the fused scan (``kvtriton.planner.scan``) and the loop reference
(``kvtriton.planner.reference``) agree, and no reference leaks.

Each example drives planner drivers built identically (same layout, pools and actions, so block
ids line up) through admissions with shared prefixes and partial CPU acceptance, chunked prefill,
decode, idle steps, confirmed-token jitter (output placeholders), random CPU evictions, delayed,
reordered, partial (``world_size=2``) and failed completions, preemption with resumption, and
finish. After
every step the two planners must emit the same ``PlannerMeta``, hold the same cursors and report
the same stats (all but the measured selection time), every pool reference must be accounted for
(``PlannerDriver.check_invariants``) and the planner's and selector's books must hold
(``OffloadPlanner.check_invariants``).
Once every request finished and every transfer completed, both pools must be all-free.
Lazy mode runs the same schedules on single-group layouts and, with the fused and loop planners
in lockstep, on hybrid ones (full attention with a sliding window, and with a window and Mamba
states), where every store must name the group of its GPU block's key.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.planner_driver import ALIAS_TINY, HYBRID_TINY, LLAMA_TINY, PlannerDriver, tokens_for
from kvtriton.lookup import find_longest_hit
from kvtriton.planner import PlannerConfig
from kvtriton.specs import FullAttentionSpec, KVLayout, MambaSpec, SlidingWindowSpec

LAYOUTS = {"tiny": LLAMA_TINY, "alias": ALIAS_TINY, "hybrid": HYBRID_TINY}
# Lazy mode on every group kind at once: full attention and a 24-token window in 8-token blocks,
# Mamba states every 16 tokens (the scheduler block).
THREE_KINDS = KVLayout([FullAttentionSpec(8, 1, 8, 1),
                        SlidingWindowSpec(8, 1, 8, 1, sliding_window=24),
                        MambaSpec(16, (4,), (8,), 1)], name="three-kinds")
LAZY_HYBRID = {"hybrid": HYBRID_TINY, "three": THREE_KINDS}
MAX_RUNNING = 5
STEPS = 60


def _meta_tuple(meta):
    s, ld = meta.store, meta.load
    return ((s.event, s.gpu_blocks, s.cpu_blocks, s.groups),
            (ld.event, ld.gpu_blocks, ld.cpu_blocks, ld.groups),
            meta.load_event_to_reqs, meta.need_flush)


def _cursors(h: PlannerDriver) -> dict:
    out = {}
    for rid in list(h.running) + list(h.preempted):
        for g in range(h.G):
            try:
                out[rid, g] = h.planner.cursor(rid, g)
            except ValueError:
                out[rid, g] = None
    return out


class Lockstep:
    """The same actions on every driver; observable results must agree."""

    def __init__(self, layout, gpu_blocks: int, cpu_blocks: int,
                 configs: list[PlannerConfig]) -> None:
        self.hs = [PlannerDriver(layout, gpu_blocks, cpu_blocks, cfg, free_out_of_window=True)
                   for cfg in configs]
        self.h = self.hs[0]
        self.n_req = 0
        self.steps = 0

    def all(self, fn):
        results = [fn(h) for h in self.hs]
        for r in results[1:]:
            assert r == results[0], f"after step {self.steps}, drivers disagree: {results}"
        return results[0]

    def compare(self) -> None:
        self.all(_cursors)
        self.all(lambda h: h.planner.stats.as_dict(measured=False))
        self.all(lambda h: h.planner.selector.running_present)
        for h in self.hs:
            h.check_invariants()
            h.planner.check_invariants()  # includes running_present, recomputed from the keys

    def step(self, scheduled: dict[str, int]) -> None:
        metas = [h.step(dict(scheduled)) for h in self.hs]
        for m in metas[1:]:
            assert _meta_tuple(m) == _meta_tuple(metas[0]), f"step {self.steps}: metas differ"
        self.steps += 1
        self.compare()


def _servable(h: PlannerDriver, req, accept: int | None) -> int | None:
    """``accept``, or 0 where a sliding window or a Mamba state makes that shorter CPU hit a
    set of blocks the CPU lacks (the planner refuses it; a scheduler then takes none). Looked
    up without pinning anything, so the drivers stay in step."""
    if not accept or all(g.kind == "full" for g in h.layout.groups):
        return accept
    hbs = h.layout.hash_block_size
    local = h.gpu_hit(req).num_tokens
    cap = req.num_tokens - 1 - local
    if local % h.layout.scheduler_block_size or accept >= cap:
        return accept
    keys = req.keys[:, local // hbs:].tolist()
    hit = find_longest_hit(h.layout, h.cpu, keys, cap).num_tokens
    if not 0 < accept < hit:
        return accept
    short = find_longest_hit(h.layout, h.cpu, [k[:accept // hbs] for k in keys], accept)
    return accept if short.num_tokens == accept else 0


def _drive(data, lock: Lockstep) -> None:
    h = lock.h
    layout = h.layout
    B = layout.scheduler_block_size
    hbs = layout.hash_block_size
    world = h.planner.config.world_size
    draw = data.draw
    for _ in range(STEPS):
        # -- admissions and resumptions
        if len(h.running) < MAX_RUNNING and draw(st.integers(0, 2)) > 0:
            family = draw(st.integers(0, 3))
            shared = draw(st.integers(0, 8)) * B + draw(st.sampled_from([0, 0, 5, hbs]))
            own = draw(st.integers(1, 3 * B))
            output = draw(st.integers(0, 2 * B))
            lock.n_req += 1
            rid = f"r{lock.n_req}"
            toks = tokens_for(family, shared) + tokens_for(1000 + lock.n_req, own + output)
            if draw(st.integers(0, 2)) == 0:
                toks = tokens_for(family, shared + own + output)  # an exact repeat of the family
            reqs = [hh.request(rid, toks, output) for hh in lock.hs]
            need = h.blocks_needed(reqs[0], reqs[0].num_tokens + output)
            if need + 8 <= h.gpu.num_free_blocks:
                accept = _servable(h, reqs[0], draw(st.sampled_from([None, None, 0, hbs, B,
                                                                      2 * B])))
                for hh, req in zip(lock.hs, reqs, strict=True):
                    hh.admit(req, accept)
        if h.preempted and draw(st.integers(0, 2)) == 0:
            rid = draw(st.sampled_from(sorted(h.preempted)))
            req = h.preempted[rid]
            if h.blocks_needed(req) + 8 <= h.gpu.num_free_blocks:
                accept = _servable(h, req, draw(st.sampled_from([None, 0, B])))
                lock.all(lambda hh, rid=rid, accept=accept: hh.resume(rid, accept))
        # -- preemption, finish, confirmed-token jitter
        if h.running and draw(st.integers(0, 7)) == 0:
            rid = draw(st.sampled_from(sorted(h.running)))
            if not h.planner.load_pending(rid):
                lock.all(lambda hh, rid=rid: hh.preempt(rid))
        live = sorted(h.running) + sorted(h.preempted)
        if live and draw(st.integers(0, 5)) == 0:
            rid = draw(st.sampled_from(live))
            lock.all(lambda hh, rid=rid: hh.finish(rid))
        if h.running and draw(st.integers(0, 9)) == 0:
            rid = draw(st.sampled_from(sorted(h.running)))
            ph = draw(st.integers(0, min(h.running[rid].req.num_computed_tokens, 2 * B)))
            for hh in lock.hs:
                hh.running[rid].req.num_output_placeholders = ph
        # -- outside pressure on the CPU tier, and on the GPU prefix cache (so CPU hits happen)
        for _ in range(draw(st.integers(0, 2))):
            victims = h.free_cached_cpu_blocks()
            if not victims:
                break
            b = victims[draw(st.integers(0, len(victims) - 1))]
            lock.all(lambda hh, b=b: hh.cpu.evict_cached(b))
        if draw(st.booleans()):
            victims = [b for b in h.gpu.iter_free() if h.gpu.block_hash(b) is not None]
            for b in victims[:draw(st.integers(0, len(victims)))]:
                lock.all(lambda hh, b=b: hh.gpu.evict_cached(b))
        # -- the step
        scheduled, budget = {}, h.gpu.num_free_blocks - 4
        for rid in sorted(h.running):
            if h.planner.load_pending(rid):
                continue
            run = h.running[rid]
            left = run.req.num_tokens - run.req.num_computed_tokens
            mode = draw(st.integers(0, 3))
            n = 0 if mode == 0 else (draw(st.integers(1, left)) if left > 0 else 1)
            grow = h.grow_need(rid, n)
            if grow > budget:
                n = max(0, min(n, left))
                grow = h.grow_need(rid, n)
            if grow <= budget:
                budget -= grow
                scheduled[rid] = n
        lock.step(scheduled)
        # -- completions, delayed and reordered
        for ev in sorted(h.loads):
            c = draw(st.integers(0, 5))
            if c >= 2:
                lock.all(lambda hh, ev=ev, c=c: hh.complete_loads([ev], failed=c == 5))
        events = sorted(h.stores)
        if events:
            events = draw(st.permutations(events))
        for ev in events:
            c = draw(st.integers(0, 9))
            if c == 9:
                lock.all(lambda hh, ev=ev: hh.complete_stores([], failed=[ev]))
            elif c >= 4:
                n = 1 if world > 1 and c < 6 else None
                lock.all(lambda hh, ev=ev, n=n: hh.complete_stores([ev], reports=n))
        lock.compare()
    # -- drain: finish everything, complete everything, flush; then nothing is left referenced
    for rid in sorted(h.running) + sorted(h.preempted):
        lock.all(lambda hh, rid=rid: hh.finish(rid))
    for _ in range(3):
        lock.step({})
        lock.all(lambda hh: hh.complete_all())
        lock.compare()
    for hh in lock.hs:
        assert not hh.planner.has_pending_work()
        assert hh.gpu.num_used_blocks == 0, "GPU blocks leaked"
        assert hh.cpu.num_used_blocks == 0, "CPU blocks leaked (pins never released)"
        for rid in [f"r{i}" for i in range(1, lock.n_req + 1)]:
            assert not hh.planner.has_request(rid)
        hh.planner.check_invariants(idle=True)


@given(data=st.data(),
       layout=st.sampled_from(sorted(LAYOUTS)),
       gpu_blocks=st.sampled_from([40, 64, 128]),
       cpu_blocks=st.integers(4, 40),
       restore=st.booleans(),
       per_step=st.sampled_from([None, None, 0, 1, 3]),
       per_key=st.sampled_from([None, None, 0, 1, 2]),
       order=st.sampled_from(["tail_first", "head_first"]),
       scan_idle=st.booleans(),
       share=st.sampled_from([None, None, 0.0, 0.5, 0.9]),
       world=st.sampled_from([1, 1, 2]),
       fine=st.booleans())
def test_fused_scan_matches_loop_reference(data, layout, gpu_blocks, cpu_blocks, restore,
                                           per_step, per_key, order, scan_idle, share, world,
                                           fine):
    common = dict(restore=restore, max_restores_per_step=per_step, max_restores_per_key=per_key,
                  cpu_free_order=order, scan_idle=scan_idle, restore_share=share,
                  world_size=world, fine_grained=fine and layout == "alias")
    lock = Lockstep(LAYOUTS[layout], gpu_blocks, cpu_blocks,
                    [PlannerConfig(scan="fused", **common), PlannerConfig(scan="loop", **common)])
    _drive(data, lock)


@pytest.mark.parametrize("layout", ["tiny", "alias"])
@given(data=st.data(), gpu_blocks=st.sampled_from([40, 64]), cpu_blocks=st.integers(4, 40),
       target=st.sampled_from([None, 2, 8, 32]))
def test_lazy_mode_invariants(data, layout, gpu_blocks, cpu_blocks, target):
    lock = Lockstep(LAYOUTS[layout], gpu_blocks, cpu_blocks,
                    [PlannerConfig(lazy=True, lazy_target_blocks=target)])
    _drive(data, lock)


@pytest.mark.parametrize("layout", sorted(LAZY_HYBRID))
@settings(max_examples=max(10, settings().max_examples // 4), deadline=None)
@given(data=st.data(), gpu_blocks=st.sampled_from([64, 96]), cpu_blocks=st.integers(4, 40),
       target=st.sampled_from([None, 4, 16, 64]), world=st.sampled_from([1, 1, 2]),
       order=st.sampled_from(["tail_first", "head_first"]))
def test_lazy_mode_fused_matches_loop_on_hybrid_layouts(data, layout, gpu_blocks, cpu_blocks,
                                                        target, world, order):
    """Lazy mode on layouts of several groups (full attention with a sliding window, and with a
    window and Mamba states): the fused and loop planners pick the same free-queue blocks with
    the same groups, and every block stored is named with the group whose key it holds."""
    common = dict(lazy=True, lazy_target_blocks=target, world_size=world, cpu_free_order=order)
    lock = Lockstep(LAZY_HYBRID[layout], gpu_blocks, cpu_blocks,
                    [PlannerConfig(scan="fused", **common), PlannerConfig(scan="loop", **common)])
    h = lock.h
    key_group: dict[int, int] = {}
    real_request, real_step = h.request, h.step

    def request(rid, tokens, output=0):
        req = real_request(rid, tokens, output)
        for g, row in enumerate(req.keys.tolist()):
            key_group.update(dict.fromkeys(row, g))
        return req

    def step(scheduled=None, **kw):
        meta = real_step(scheduled, **kw)
        s = meta.store
        for b, g in zip(s.gpu_blocks, s.groups, strict=True):
            assert g == key_group[h.gpu.block_hash(b)], f"GPU block {b} stored as group {g}"
        return meta

    h.request, h.step = request, step
    _drive(data, lock)
    # Every CPU block the lazy stores registered names the group of its key.
    for c in range(1, h.cpu.num_blocks):
        if (k := h.cpu.block_hash(c)) is not None:
            assert h.cpu.block_group(c) == key_group[k]


@pytest.mark.parametrize("restore", [False, True], ids=["control", "restore"])
@settings(deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["cpu_alloc", "cpu_cache", "cpu_free", "cpu_drop",
                                               "gpu_alloc", "gpu_cache", "gpu_free"]),
                              st.integers(0, 30)), min_size=1, max_size=50))
def test_batch_listeners_match_per_key_listeners(restore, ops):
    """Two fused selectors on the same pools, one told of every hash change key by key as it
    happens, the other by the batch listeners once per pool call: their books stay equal.
    Keys are shared by rows (a common prefix) and by blocks (aliases, one key in two blocks)."""
    import numpy as np

    from helpers.planner_state import deep_state
    from kvtriton.planner.scan import FusedSelector
    from kvtriton.pool import BlockPool

    gpu, cpu = BlockPool(16), BlockPool(12, medium="CPU")
    per_key = FusedSelector(LLAMA_TINY, gpu, cpu, restore=restore)
    batched = FusedSelector(LLAMA_TINY, gpu, cpu, restore=restore)
    gpu.add_listener(per_key.on_gpu_insert, per_key.on_gpu_evict)
    cpu.add_listener(per_key.on_cpu_insert, per_key.on_cpu_evict)
    gpu.add_batch_listener(batched.on_gpu_insert_many, batched.on_gpu_evict_many)
    cpu.add_batch_listener(batched.on_cpu_insert_many, batched.on_cpu_evict_many)
    for sel in (per_key, batched):
        sel.admit(0, [np.arange(10, 18)])
        sel.admit(1, [np.r_[10:14, 40:44]])
    held = {"cpu": [], "gpu": []}
    for op, a in ops:
        side, what = op.split("_")
        pool = cpu if side == "cpu" else gpu
        mine = held[side]
        if what == "alloc":
            mine += pool.get_new_blocks(min(a % 6, pool.num_free_blocks))
        elif what == "cache":
            bare = [b for b in mine if pool.block_hash(b) is None][:1 + a % 3]
            owned = [*range(10, 18), *range(40, 44), 50]
            pool.cache_blocks(bare, [[owned[(a + i) % len(owned)],
                                      *([owned[a % 5]] if a % 4 == 0 else [])]
                                     for i, _ in enumerate(bare)])
        elif what == "free" and mine:
            pool.free_blocks([mine.pop(a % len(mine))])
        elif what == "drop":
            free_cached = [b for b in pool.iter_free() if pool.block_hash(b) is not None]
            if free_cached:
                pool.evict_cached(free_cached[a % len(free_cached)])
        state = [{k: deep_state(v) for k, v in vars_of(sel).items()}
                 for sel in (per_key, batched)]
        assert [k for k in state[0] if state[0][k] != state[1][k]] == []
        batched.check_invariants()


def vars_of(sel) -> dict:
    """A selector's books, less its timer and its per-pass scratch (which holds garbage)."""
    return {name: getattr(sel, name) for name in dir(sel)
            if not name.startswith("__") and not callable(getattr(sel, name))
            and name not in ("key_slots", "listen_s", "_first_scratch")}
