"""Rank functions for tests/test_collectives.py (module level, so spawn can pickle them).

One spawn of 8 ranks does every check; world sizes 1..8 are subgroups ``new_group(range(k))``
(plus a non-contiguous one, ranks 2, 5, 7, to catch group-rank / global-rank mix-ups).
Each check appends a readable line to a list of failures; the tests assert the lists are empty.

Data for exact checks: small integers (|x| <= 8), so every partial sum of up to 8 ranks is
exactly representable in fp32, fp16, bf16 and int64: the sum does not depend on the order of
additions and both oracles (a float64 sum computed locally from every rank's seed, and gloo's
own collective) must match our result *bitwise*.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from minifsdp.comm import collectives as C
from minifsdp.comm import ring as textbook
from minifsdp.comm.ring import chunk_bounds
from minifsdp.comm.stream import stream_for
from minifsdp.comm.tuned import collectives as tuned
from minifsdp.comm.tuned.header import HEADER_BYTES
from minifsdp.comm.tuned.pipeline import all_reduce_in_place
from minifsdp.comm.tuned.seat import Seat

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def _data(global_rank: int, numel: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``global_rank``'s small-integer tensor; any rank can rebuild any other rank's."""
    gen = torch.Generator().manual_seed(1000 * global_rank + 7 * numel + 31 * DTYPES.index(dtype) + salt)
    return torch.randint(-8, 9, (numel,), generator=gen).to(dtype)


def _exact_sum(members, numel, dtype, salt=0) -> torch.Tensor:
    return sum(_data(g, numel, dtype, salt).double() for g in members).to(dtype)


def _groups():
    """Every rank must call new_group for every group, member or not."""
    world = dist.get_world_size()
    groups = [(list(range(k)), dist.new_group(list(range(k)))) for k in range(1, world + 1)]
    groups.append(([2, 5, 7], dist.new_group([2, 5, 7])))
    return [(members, g) for members, g in groups if dist.get_rank() in members]


def _check_exact(fails, groups):
    me = dist.get_rank()
    for members, g in groups:
        k = len(members)
        for numel in sorted({0, k - 1, 2 * k + 3, 1000}):  # empty, fewer than N, uneven, bigger
            for dtype in DTYPES:
                where = f"N={k} members={members} numel={numel} {dtype}"
                exact = _exact_sum(members, numel, dtype)
                shape = (numel // 4, 4) if numel % 4 == 0 and numel else (numel,)  # 2-D too: we flatten
                ours = _data(me, numel, dtype).reshape(shape)
                C.ring_all_reduce(ours, group=g)
                if not torch.equal(ours.reshape(-1), exact):
                    fails.append(f"ring sum != exact sum: {where}")
                book = _data(me, numel, dtype).reshape(shape)
                textbook.ring_all_reduce(book, group=g)
                if not torch.equal(book.reshape(-1), exact):
                    fails.append(f"textbook ring sum != exact sum: {where}")
                if dtype in (torch.float32, torch.int64):  # the second oracle, where it adds nothing new skip it
                    gloo = _data(me, numel, dtype)
                    dist.all_reduce(gloo, group=g)
                    if not torch.equal(ours.reshape(-1), gloo):
                        fails.append(f"ring sum != gloo all_reduce: {where}")
                if dtype.is_floating_point and numel % 2:
                    avg = _data(me, numel, dtype)
                    C.ring_all_reduce(avg, op="avg" if dtype == torch.float32 else dist.ReduceOp.AVG, group=g)
                    if not torch.equal(avg, exact / k):  # same division op, same dtype: bitwise
                        fails.append(f"ring avg != exact sum / N: {where}")
                if dtype == torch.float32:
                    naive = _data(me, numel, dtype)
                    C.naive_all_reduce(naive, group=g, root=k - 1)
                    if not torch.equal(naive, exact):
                        fails.append(f"naive sum != exact sum: {where}")


def _check_pieces(fails, groups):
    """Tensors big enough that chunks move in several pipelined pieces (tuned/pipeline.py, PIECE_BYTES), sizes
    no world size divides; at N=2 both the swap (what ring_all_reduce runs) and the ring itself."""
    me = dist.get_rank()
    numel = 5 * (1 << 18) + 7  # 5 MB of float32: N=2 swaps 5 pieces; N=3 chunks of 2 pieces, N=4 too
    for members, g in groups:
        k = len(members)
        if k not in (2, 3, 4) and members != [2, 5, 7]:
            continue
        where = f"N={k} members={members} numel={numel}"
        exact = _exact_sum(members, numel, torch.float32)
        ours, avg = _data(me, numel, torch.float32), _data(me, numel, torch.float32)
        C.ring_all_reduce(ours, group=g)
        C.ring_all_reduce(avg, op="avg", group=g)
        if not torch.equal(ours, exact):
            fails.append(f"ring sum != exact sum: {where}, {(ours != exact).sum().item()} elements differ")
        if not torch.equal(avg, exact / k):  # divided once by the chunk's owner, then gathered: bitwise
            fails.append(f"ring avg != exact sum / N: {where}")
        if k == 2:  # the pipelined ring at 2 ranks (ring_all_reduce swaps instead: tuned/swap.py)
            flat = _data(me, numel, torch.float32)
            all_reduce_in_place(Seat(g, stats=()), flat, "avg")
            if not torch.equal(flat, exact / 2):
                fails.append(f"tuned all_reduce_in_place at 2 ranks != exact sum / 2: {where}")


def _check_rs_ag(fails, groups):
    me = dist.get_rank()
    for members, g in groups:
        k, r = len(members), dist.get_rank(g)
        for m in (0, 1, 5):
            for dtype in (torch.float32, torch.bfloat16, torch.int64) if m == 5 else (torch.float32,):
                where = f"N={k} members={members} chunk={m} {dtype}"
                inp = _data(me, k * m, dtype, salt=1)
                before = inp.clone()
                out = torch.full((m,), -99, dtype=dtype)
                C.ring_reduce_scatter(out, inp, group=g)
                exact = _exact_sum(members, k * m, dtype, salt=1)[r * m : (r + 1) * m]
                if not torch.equal(out, exact):
                    fails.append(f"reduce_scatter != exact chunk r of the sum: {where}")
                if not torch.equal(inp, before):
                    fails.append(f"reduce_scatter modified its input: {where}")
                ref = torch.empty_like(out)
                C.get_collectives("torch").reduce_scatter(ref, inp, group=g)
                if not torch.equal(out, ref):
                    fails.append(f"reduce_scatter != gloo reduce_scatter: {where}")
                gathered = torch.full((k, m), -99, dtype=dtype)  # 2-D output, like FSDP's
                C.ring_all_gather(gathered, out, group=g)
                if not torch.equal(gathered.reshape(-1), _exact_sum(members, k * m, dtype, salt=1)):
                    fails.append(f"all_gather(reduce_scatter(x)) != all_reduce(x): {where}")
                if dtype.is_floating_point:
                    avg = torch.empty(m, dtype=dtype)
                    C.ring_reduce_scatter(avg, inp, op="avg", group=g)
                    if not torch.equal(avg, exact / k):
                        fails.append(f"reduce_scatter avg != exact / N: {where}")
                if m == 5 and dtype == torch.float32:  # output is this rank's chunk of input (in place)
                    inplace = inp.clone()
                    C.ring_reduce_scatter(inplace.view(k, m)[r], inplace, group=g)
                    if not torch.equal(inplace.view(k, m)[r], exact):
                        fails.append(f"reduce_scatter into its own input's chunk != exact chunk: {where}")


def _check_tuned_vs_textbook(fails, groups):
    """The tuned ring (comm/tuned/) against the textbook ring (comm/ring.py) on the same random inputs:
    bitwise, at N = 2, 3, 4 (and ranks 2, 5, 7), sizes no world size divides, sum and avg, four dtypes.
    Random normal data (not small integers): every rounding of every partial sum must be the same.
    At N=2 each all-reduce runs twice: the first of a size is swapped, the second carried in the header.
    The last size is big enough for pipelined pieces (tuned/pipeline.py)."""
    me = dist.get_rank()
    for members, g in groups:
        k, r = len(members), dist.get_rank(g)
        if k not in (2, 3, 4) and members != [2, 5, 7]:
            continue
        for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.int64):
            sizes = (1, 7, 1001) + ((5 * (1 << 18) + 5,) if dtype != torch.int64 else ())
            for numel, op in ((numel, op) for numel in sizes for op in ("sum", "avg")):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                where = f"N={k} members={members} numel={numel} {dtype} {op}"
                gen = torch.Generator().manual_seed(1000 * me + numel)
                x = (torch.randn(numel, generator=gen) * 100).to(dtype) if dtype.is_floating_point \
                    else torch.randint(-(2**40), 2**40, (numel,), generator=gen)
                want = x.clone()
                textbook.ring_all_reduce(want, op=op, group=g)
                for attempt in range(2 if k == 2 else 1):
                    got = x.clone()
                    C.ring_all_reduce(got, op=op, group=g)
                    if got.shape != want.shape or not torch.equal(got, want):
                        fails.append(f"tuned all-reduce != textbook (call {attempt}): {where}, "
                                     f"{(got != want).sum().item()} of {numel} differ")
                rs_in, m = x[: (numel // k) * k], numel // k  # reduce-scatter: k chunks of m
                want_rs, got_rs = torch.empty(m, dtype=dtype), torch.empty(m, dtype=dtype)
                textbook.ring_reduce_scatter(want_rs, rs_in, op=op, group=g)
                C.ring_reduce_scatter(got_rs, rs_in, op=op, group=g)
                if got_rs.shape != want_rs.shape or not torch.equal(got_rs, want_rs):
                    fails.append(f"tuned reduce-scatter != textbook: {where}")
                if numel > 1001:  # an all-gather only copies: small sizes show a wrong place as well
                    continue
                want_ag, got_ag = torch.empty(k * numel, dtype=dtype), torch.empty(k * numel, dtype=dtype)
                textbook.ring_all_gather(want_ag, x, group=g)
                C.ring_all_gather(got_ag, x, group=g)
                if not torch.equal(got_ag, want_ag) or not torch.equal(want_ag[r * numel:(r + 1) * numel], x):
                    fails.append(f"tuned all-gather != textbook, or not our input in chunk r: {where}")


def _check_random_floats(fails):
    """Random normal data, world of 8: not exactly representable, so a tolerance, with its reason."""
    n, me = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(me)
    x = torch.randn(4099, generator=gen)
    everyone = [torch.randn(4099, generator=torch.Generator().manual_seed(g)) for g in range(n)]
    exact = torch.stack(everyone).double().sum(0)
    bound_scale = torch.stack(everyone).double().abs().sum(0)  # sum |x_i|
    for dtype, unit_roundoff in ((torch.float32, 2.0**-24), (torch.bfloat16, 2.0**-8), (torch.float16, 2.0**-11)):
        ours = x.to(dtype, copy=True)
        C.ring_all_reduce(ours)
        # Recursive summation of n terms (inputs first rounded to dtype): |err| <= (n + 1) u sum|x_i|.
        err = (ours.double() - exact).abs()
        if not bool((err <= (n + 1) * unit_roundoff * bound_scale + 1e-30).all()):
            fails.append(f"{dtype}: error {err.max():.3g} above the summation bound")
    ours, gloo = x.clone(), x.clone()
    C.ring_all_reduce(ours)
    dist.all_reduce(gloo)
    # fp32, 8 ranks: different addition order than gloo; rtol 1e-5 ~ a few ulps of the partial sums.
    if not torch.allclose(ours, gloo, rtol=1e-5, atol=1e-5):
        fails.append(f"fp32 random: ring vs gloo max diff {(ours - gloo).abs().max():.3g}")


def _check_async(fails):
    me = dist.get_rank()
    if me == 0:
        time.sleep(0.3)  # the others issue first; their rings cannot finish without rank 0
    tensors = [torch.full((n,), float(me)) for n in (10, 1000, 3, 100_000)]
    works = [C.ring_all_reduce(t, async_op=True) for t in tensors]
    if me != 0 and works[0].is_completed():
        fails.append("async all-reduce reported completed before rank 0 had even joined")
    inp = torch.arange(8 * 6, dtype=torch.float32) + me
    rs_out, ag_out = torch.empty(6), torch.empty(8 * 6)
    works.append(C.ring_reduce_scatter(rs_out, inp, async_op=True))
    busy = torch.randn(200, 200) @ torch.randn(200, 200)  # the caller keeps computing meanwhile
    works[-1].wait()
    works.append(C.ring_all_gather(ag_out, rs_out, async_op=True))
    book = torch.full((5,), float(me))
    works.append(C.get_collectives("textbook").all_reduce(book, async_op=True))  # the same stream, in order
    last = torch.ones(7)
    C.ring_all_reduce(last)  # synchronous: queued behind every async one (issue order)
    if not torch.equal(book, torch.full((5,), float(sum(range(8))))):
        fails.append(f"async textbook all-reduce between tuned ones gave {book.tolist()}")
    if not all(w.is_completed() for w in works):
        fails.append("a synchronous collective returned before earlier async ones finished (not FIFO)")
    for w in works:
        w.wait()
    total = float(sum(range(8)))
    for t in tensors:
        if not torch.equal(t, torch.full_like(t, total)):
            fails.append(f"async all-reduce of {t.numel()} elements gave {t[:3].tolist()}")
    expected_rs = (torch.arange(8 * 6, dtype=torch.float32) * 8 + total)
    if not torch.equal(ag_out, expected_rs) or not torch.equal(last, torch.full((7,), 8.0)):
        fails.append("async reduce-scatter / all-gather or the following sync all-reduce is wrong")
    del busy


def _check_bytes(fails, groups):
    for members, g in groups:
        k, r = len(members), dist.get_rank(g)
        if k not in (2, 4, 8):
            continue
        # divisible by N, then not; at N=2 one too big to ride in the header message (the swap path)
        sizes = (4096, 4099, 5, 3) + ((C.CARRY_BYTES // 4 + 1,) if k == 2 else ())
        for numel, (name, all_reduce) in ((m, f) for m in sizes for f in (("tuned", C.ring_all_reduce),
                                                                          ("textbook", textbook.ring_all_reduce))):
            x = torch.ones(numel)
            with C.count_bytes() as stats:
                all_reduce(x, group=g)
            b = chunk_bounds(numel, k)
            size = [(stop - start) * 4 for start, stop in b]
            # RS sends every chunk but r and receives every chunk but r-1; AG sends all but r+1, receives all but r.
            sent = 2 * numel * 4 - size[r] - size[(r + 1) % k]
            received = 2 * numel * 4 - size[(r - 1) % k] - size[r]
            if (stats.sent, stats.received) != (sent, received):
                fails.append(f"{name} N={k} numel={numel}: sent/received {stats.sent}/{stats.received}, "
                             f"want {sent}/{received}")
            if numel % k == 0 and stats.sent * k != 2 * (k - 1) * numel * 4:
                fails.append(f"{name} N={k} numel={numel}: sent {stats.sent} != 2(N-1)/N x {numel * 4}")
            lo, hi = 2 * (k - 1) * (numel // k) * 4, 2 * (k - 1) * -(-numel // k) * 4
            if not lo <= stats.sent <= hi:
                fails.append(f"{name} N={k} numel={numel}: sent {stats.sent} outside [{lo}, {hi}]")
        s = 1000 * 4
        with C.count_bytes() as stats:
            C.naive_all_reduce(torch.ones(1000), group=g, root=0)
        want = (k - 1) * s if r == 0 else s
        if (stats.sent, stats.received) != (want, want):
            fails.append(f"naive N={k} rank {r}: sent/received {stats.sent}/{stats.received}, want {want}")
        for name, ring in (("tuned", C), ("textbook", textbook)):
            with C.count_bytes() as outer:
                with C.count_bytes() as inner:
                    ring.ring_reduce_scatter(torch.empty(10), torch.ones(10 * k), group=g)
                ring.ring_all_gather(torch.empty(10 * k), torch.ones(10), group=g)
            if inner.sent != (k - 1) * 40 or outer.sent != 2 * (k - 1) * 40:
                fails.append(f"{name} N={k}: RS/AG bytes {inner.sent}/{outer.sent}, "
                             f"want {(k - 1) * 40}/{2 * (k - 1) * 40}")
        with C.count_bytes() as stats:  # textbook through the comm stream, asynchronously: counted where issued
            work = C.get_collectives("textbook").all_reduce(torch.ones(4096), group=g, async_op=True)
        work.wait()
        if stats.sent * k != 2 * (k - 1) * 4096 * 4:
            fails.append(f"textbook async N={k}: sent {stats.sent}, want 2(N-1)/N x {4096 * 4}")


def _expect_error(fails, what, exc_type, match, fn):
    try:
        fn()
    except exc_type as e:
        if match not in str(e):
            fails.append(f"{what}: message {str(e)!r} does not say {match!r}")
        return str(e)
    except Exception as e:  # noqa: BLE001
        fails.append(f"{what}: raised {type(e).__name__}: {e}, expected {exc_type.__name__}")
    else:
        fails.append(f"{what}: no error raised")


def _check_textbook_errors(fails):
    """The textbook ring's own checks (comm/checks.py): the same clear errors, a mismatch raised on every
    rank without a hang, and the group still works afterwards."""
    me, n = dist.get_rank(), dist.get_world_size()
    T = textbook
    _expect_error(fails, "textbook non-contiguous", ValueError, "contiguous",
                  lambda: T.ring_all_reduce(torch.ones(4, 4).t()))
    _expect_error(fails, "textbook RS sizes", ValueError, "world_size x output.numel()",
                  lambda: T.ring_reduce_scatter(torch.empty(3), torch.ones(3 * n + 1)))
    _expect_error(fails, "textbook AG sizes", ValueError, "world_size x input.numel()",
                  lambda: T.ring_all_gather(torch.empty(3 * n - 1), torch.ones(3)))
    _expect_error(fails, "textbook op max", ValueError, "not supported",
                  lambda: T.ring_all_reduce(torch.ones(3), op="max"))
    _expect_error(fails, "textbook int avg", TypeError, "divide",
                  lambda: T.ring_all_reduce(torch.ones(3, dtype=torch.int64), op="avg"))
    _expect_error(fails, "textbook complex", TypeError, "not supported",
                  lambda: T.ring_all_reduce(torch.ones(3, dtype=torch.complex64)))
    msg = _expect_error(fails, "textbook sizes differ across ranks", ValueError, "rank 3: all_reduce, 11 elements",
                        lambda: T.ring_all_reduce(torch.ones(11 if me == 3 else 10)))
    if msg is not None and "rank 0: all_reduce, 10 elements" not in msg:
        fails.append(f"textbook size mismatch message does not list every rank: {msg}")
    _expect_error(fails, "textbook collectives differ across ranks", ValueError, "different collectives",
                  lambda: T.ring_all_reduce(torch.ones(n)) if me else T.ring_all_gather(torch.empty(n), torch.ones(1)))
    _expect_error(fails, "textbook via get_collectives, async, sizes differ", ValueError, "different tensors",
                  lambda: C.get_collectives("textbook").all_reduce(torch.ones(5 + (me == 2)), async_op=True).wait())
    after = torch.ones(5)
    T.ring_all_reduce(after)
    if not torch.equal(after, torch.full((5,), float(n))):
        fails.append("textbook: after a mismatch error the next all-reduce is wrong")


def _check_errors(fails):
    me, n = dist.get_rank(), dist.get_world_size()
    _expect_error(fails, "non-contiguous", ValueError, "contiguous",
                  lambda: C.ring_all_reduce(torch.ones(4, 4).t()))
    _expect_error(fails, "RS sizes", ValueError, "world_size x output.numel()",
                  lambda: C.ring_reduce_scatter(torch.empty(3), torch.ones(3 * n + 1)))
    _expect_error(fails, "AG sizes", ValueError, "world_size x input.numel()",
                  lambda: C.ring_all_gather(torch.empty(3 * n - 1), torch.ones(3)))
    _expect_error(fails, "op max", ValueError, "not supported", lambda: C.ring_all_reduce(torch.ones(3), op="max"))
    _expect_error(fails, "op MAX", ValueError, "not supported",
                  lambda: C.ring_all_reduce(torch.ones(3), op=dist.ReduceOp.MAX))
    _expect_error(fails, "int avg", TypeError, "divide", lambda: C.ring_all_reduce(torch.ones(3, dtype=torch.int64),
                                                                                  op="avg"))
    _expect_error(fails, "mixed dtypes", TypeError, "same dtype",
                  lambda: C.ring_all_gather(torch.empty(n), torch.ones(1, dtype=torch.float64)))
    msg = _expect_error(fails, "bad kind", ValueError, "'ring'", lambda: C.get_collectives("nccl"))
    if msg is not None and not all(repr(kind) in msg for kind in C.COLLECTIVE_KINDS):
        fails.append(f"get_collectives' error does not list every kind of {C.COLLECTIVE_KINDS}: {msg}")
    # Cross-rank mismatches: every rank must raise (none may hang), then the group still works.
    msg = _expect_error(fails, "sizes differ across ranks", ValueError, "rank 3: all_reduce, 11 elements",
                        lambda: C.ring_all_reduce(torch.ones(11 if me == 3 else 10)))
    if msg is not None and "rank 0: all_reduce, 10 elements" not in msg:
        fails.append(f"size mismatch message does not list every rank: {msg}")
    _expect_error(fails, "dtypes differ across ranks", ValueError, "different tensors",
                  lambda: C.ring_all_reduce(torch.ones(10, dtype=torch.float64 if me == 1 else torch.float32)))
    _expect_error(fails, "collectives differ across ranks", ValueError, "different collectives",
                  lambda: C.ring_all_reduce(torch.ones(n)) if me else C.ring_all_gather(torch.empty(n),
                                                                                        torch.ones(1)))
    after = torch.ones(5)
    C.ring_all_reduce(after)
    if not torch.equal(after, torch.full((5,), float(n))):
        fails.append("after a mismatch error the next all-reduce is wrong")
    # Two ranks: a small all-reduce travels inside the header message (tuned/header.py, Note (doorbell)); a
    # mismatch there, or one rank small and the other too big to carry, must raise on both ranks too.
    pair = dist.new_group([0, 1])
    if me in (0, 1):
        big = C.CARRY_BYTES // 4 + 1  # float32 elements: one more than a header message may carry
        C.ring_all_reduce(torch.ones(16), group=pair)  # from now on up to 64 B ride in the header
        for what, numel in (("small sizes differ", 11 if me else 10), ("small vs too big to carry", big if me else 10)):
            _expect_error(fails, f"2 ranks, {what}", ValueError, "different tensors",
                          lambda k=numel: C.ring_all_reduce(torch.ones(k), group=pair))
        for numel in (10, big):  # and both paths still give the sum afterwards
            x = torch.full((numel,), float(me + 1))
            C.ring_all_reduce(x, group=pair)
            if not torch.equal(x, torch.full((numel,), 3.0)):
                fails.append(f"2 ranks, {numel} elements: after the mismatch errors the sum is wrong")
        # Mismatches of reduce-scatter / all-gather at 2 ranks, one against a big all-reduce (swapped:
        # tuned/swap.py): a data message sent or received without agreement would hang the next call.
        mismatches = (
            ("AG sizes differ", lambda: C.ring_all_gather(torch.empty(2 * (3 + me)), torch.ones(3 + me), group=pair)),
            ("RS vs AG", lambda: C.ring_reduce_scatter(torch.empty(4), torch.ones(8), group=pair) if me
             else C.ring_all_gather(torch.empty(8), torch.ones(4), group=pair)),
            ("RS vs big all-reduce", lambda: C.ring_reduce_scatter(torch.empty(5), torch.ones(10), group=pair) if me
             else C.ring_all_reduce(torch.ones(big), group=pair)),
        )
        for what, fn in mismatches:
            _expect_error(fails, f"2 ranks, {what}", ValueError, "different", fn)
        out, gathered = torch.empty(4), torch.empty(8)
        C.ring_reduce_scatter(out, torch.arange(8.0) * (me + 1), group=pair)
        C.ring_all_gather(gathered, torch.full((4,), float(me)), group=pair)
        if not torch.equal(out, torch.arange(4.0 * me, 4.0 * me + 4) * 3):
            fails.append(f"2 ranks: after the RS/AG mismatch errors the reduce-scatter gives {out.tolist()}")
        if not torch.equal(gathered, torch.tensor([0.0] * 4 + [1.0] * 4)):
            fails.append(f"2 ranks: after the RS/AG mismatch errors the all-gather gives {gathered.tolist()}")


def _check_carry_room(fails):
    """2 ranks: the one header receive kept between collectives holds no more than the largest all-reduce
    asked for (tuned/header.py, Note (two ranks: carry)); from the second one of a size on, it is carried."""
    me = dist.get_rank()
    pair = dist.new_group([0, 1])  # every rank calls new_group
    if me not in (0, 1):
        return
    stream = stream_for(pair)

    def kept() -> int:  # bytes of this group's header buffers: the receive posted for the next collective
        peer = stream.doorbells.get(1 - me, {"posted": []})
        return sum(b.numel() for _, b, _ in peer["posted"])

    for _ in range(3):  # what FSDP does: reduce-scatters and all-gathers only
        C.ring_reduce_scatter(torch.empty(500), torch.ones(1000), group=pair)
        C.ring_all_gather(torch.empty(1000), torch.ones(500), group=pair)
    if kept() != HEADER_BYTES:
        fails.append(f"after reduce-scatters and all-gathers only, the header buffers hold {kept()} B, "
                     f"want {HEADER_BYTES} (the next receive, no carry room)")
    swaps, real = [], tuned.swap_all_reduce
    tuned.swap_all_reduce = lambda *a: swaps.append(1) or real(*a)
    try:
        for _ in range(2):
            x = torch.full((1000,), float(me + 1))
            C.ring_all_reduce(x, group=pair)
            if not torch.equal(x, torch.full((1000,), 3.0)):
                fails.append(f"2 ranks, 1000 elements: the all-reduce gave {x[:3].tolist()}")
    finally:
        tuned.swap_all_reduce = real
    if len(swaps) != 1:
        fails.append(f"two all-reduces of 4000 B: {len(swaps)} went by the swap path, want 1 (the second is carried)")
    want = HEADER_BYTES + 4000
    if kept() != want:
        fails.append(f"after all-reduces of 4000 B the header buffers hold {kept()} B, want {want}")


def _check_facade(fails):
    n, me = dist.get_world_size(), dist.get_rank()
    results = {}
    for kind in ("ring", "textbook", "torch"):
        c = C.get_collectives(kind)
        a = _data(me, 37, torch.float32, salt=2)
        c.all_reduce(a, op="sum")
        w = c.all_reduce(b := _data(me, 37, torch.float32, salt=2), op="sum", async_op=True)
        w.wait()
        out = torch.empty(3)
        c.reduce_scatter(out, _data(me, 3 * n, torch.float32, salt=3), op="sum")
        gathered = torch.empty(3 * n)
        c.all_gather(gathered, out)
        results[kind] = (a, b, out, gathered)
    for kind in ("ring", "textbook"):
        for x, y in zip(results[kind], results["torch"], strict=True):
            if not torch.equal(x, y):
                fails.append(f"get_collectives({kind!r}) and ('torch') disagree on small-integer data")


def run_all() -> dict[str, list[str]]:
    """Everything, on 8 ranks; returns {check name: list of failures} for this rank."""
    report: dict[str, list[str]] = {}
    groups = _groups()
    t0 = time.perf_counter()
    for name, check in [
        ("exact", lambda f: _check_exact(f, groups)),
        ("pieces", lambda f: _check_pieces(f, groups)),
        ("tuned_vs_textbook", lambda f: _check_tuned_vs_textbook(f, groups)),
        ("rs_ag", lambda f: _check_rs_ag(f, groups)),
        ("random_floats", _check_random_floats),
        ("async", _check_async),
        ("bytes", lambda f: _check_bytes(f, groups)),
        ("errors", _check_errors),
        ("textbook_errors", _check_textbook_errors),
        ("carry_room", _check_carry_room),
        ("facade", _check_facade),
    ]:
        fails: list[str] = []
        check(fails)
        dist.barrier()
        report[name] = fails
        report[name + "_seconds"] = [f"{time.perf_counter() - t0:.1f}"]
    return report
