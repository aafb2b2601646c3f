"""In-place KV-cache writes: one call's tokens at pos + t, or the rows of a batched decode step into
their slots' caches.
"""

from __future__ import annotations

from tvm import tirx

from ggufc.codegen.kernels.prim_helpers import PShape


def cache_write(cache_shape: PShape, x_shape: PShape, dtype: str = "float32") -> tirx.PrimFunc:
    """In place: cache[pos + t] = x[t]. Built with the TIR IR builder since TE cannot write in place."""
    from tvm.script import ir_builder as IB
    from tvm.script.ir_builder import tirx as Tb

    with IB.IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name("cache_write")
            Tb.func_attr({"tirx.noalias": True})
            cache = Tb.arg("cache", Tb.buffer(cache_shape, dtype))
            x_h = Tb.arg("x", Tb.handle())
            pos = Tb.arg("pos", tirx.Var("pos", "int64"))
            n = tirx.Var("n", "int64")
            x = Tb.match_buffer(x_h, (n, *x_shape[1:]), dtype)
            with Tb.grid(n, *x_shape[1:]) as idx:
                idx = idx if len(x_shape) > 1 else [idx]  # one extent: grid yields a bare var
                t, rest = idx[0], idx[1:]
                Tb.buffer_store(cache, x[(t, *rest)], [pos + t, *rest])
    return ib.get()


def cache_write_rows(cache_shape: PShape, x_shape: PShape, dtype: str = "float32") -> tirx.PrimFunc:
    """In place, for the rows of a batched decode step: cache[slots[t], positions[t]] = x[t], the
    caches of every slot stacked on a leading axis (cache [S, C, ...])."""
    from tvm.script import ir_builder as IB
    from tvm.script.ir_builder import tirx as Tb

    with IB.IRBuilder() as ib:
        with Tb.prim_func():
            Tb.func_name("cache_write_rows")
            Tb.func_attr({"tirx.noalias": True})
            n_slots, n = tirx.Var("s", "int64"), tirx.Var("n", "int64")
            cache_h = Tb.arg("cache", Tb.handle())
            x_h = Tb.arg("x", Tb.handle())
            slots_h = Tb.arg("slots", Tb.handle())
            positions_h = Tb.arg("positions", Tb.handle())
            cache = Tb.match_buffer(cache_h, (n_slots, *cache_shape), dtype)
            x = Tb.match_buffer(x_h, (n, *x_shape[1:]), dtype)
            slots = Tb.match_buffer(slots_h, (n,), "int32")
            positions = Tb.match_buffer(positions_h, (n,), "int32")
            with Tb.grid(n, *x_shape[1:]) as idx:
                idx = idx if len(x_shape) > 1 else [idx]
                t, rest = idx[0], idx[1:]
                where = [slots[t].astype("int64"), positions[t].astype("int64"), *rest]
                Tb.buffer_store(cache, x[(t, *rest)], where)
    return ib.get()
