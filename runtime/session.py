"""Run a compiled artifact: one Relax VM call per chunk of tokens, states kept between calls.

Calling convention (set by codegen, recorded in the manifest):

    logits = vm[fn](tokens, ShapeTuple([pos]), states, *weights)

`tokens` is int32 [T], `pos` the number of tokens already in the context, `states` (KV cache,
recurrent state, ...) a tuple built once at load; the kernels update `states` in place. `weights`
are built once at load too: on the CPU each weight array is an argument of its own, on a GPU
they are one tuple. `prefill_all` returns float32 [T, V]; `prefill` and `decode` (T == 1) return [1, V].
"""

from __future__ import annotations

import copy
import gc
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ggufc.messages import GgufcError

from .artifact import (
    KERNELS_NAME,
    LAYOUT_FUNCTION,
    MANIFEST_NAME,
    WINDOW_KIND,
    ArtifactError,
    WindowCells,
    aligned_empty,
    aligned_zeros,
    array_layout,
    check_layout_contract,
    one_line,
    sha256_file,
)
from .artifact_reader import Artifact, open_artifact, read_weights
from .context import (
    PER_POSITION,
    RECURRENT,
    ContextHistory,
    ContextStats,
    common_prefix,
    default_interval,
    split_points,
    state_kinds,
)
from .cuda_runtime import provide_cuda_binary
from .plan_format import BackendUnavailableError
from .plan_runtime import PlanError, PlanRunner
from .state_file import SavedState, StateFileError, read_state_file, write_state_file
from .targets import TARGET_KEY_OF_DEVICE

VERIFY = "verify"  # all logits, each row as a one-token call computes it (CPU artifacts have it)
EMBED = "embed"  # the final hidden states [T, n_embd], the output matrix's input (CPU artifacts have it)
PLAN_DEVICES = ("vulkan", "metal")  # artifacts run from a dispatch plan, not a Relax VM executable

# Session device name -> the manifest's target_key the kernels must have been built for.
DEVICE_TARGET_KEYS = TARGET_KEY_OF_DEVICE


def reserve_cpu_threads(threads: int | None = None) -> int:
    """Make TVM's pool big enough for `threads` (default: every CPU we may run on); returns the count.

    The pool is created once, when the first parallel kernel runs, with TVM_NUM_THREADS workers
    (default: half the CPUs); reconfiguring it later can only use fewer. So this must run before
    any kernel does; an explicit TVM_NUM_THREADS from the user wins.
    """
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    available = len(allowed) if allowed else os.cpu_count() or 1
    n = int(threads or available)
    os.environ.setdefault("TVM_NUM_THREADS", str(max(n, available)))
    return n


def configure_cpu_threads(threads: int | None = None) -> int:
    """Size TVM's CPU thread pool: by default one thread per CPU this process may run on.

    TVM's own default is half the logical CPUs on x86 (it assumes hyper-threads), which on a
    2-vCPU machine leaves one core idle.
    """
    import tvm

    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    n = reserve_cpu_threads(threads)
    tvm.get_global_func("runtime.config_threadpool")(0, n)
    if allowed:  # reconfiguring pins the calling thread; give it back every CPU it had
        os.sched_setaffinity(0, allowed)
    return n


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass
class ReleasedDevice:
    """What `release_device` kept: host copies of the states in use (None: states stayed)."""

    states: dict[int, np.ndarray] | None


class SharedWeights:
    """An artifact's kernels and weights on a device, loaded once for every session that shares
    them (the slots of a server): loaded when the first of them needs them, dropped when the last
    one lets go (`Session.release_device`)."""

    def __init__(self, artifact: Artifact, device: Any, on_cpu: bool) -> None:
        self._artifact, self._device, self._on_cpu = artifact, device, on_cpu
        self._loaded: tuple[dict[str, Any], tuple[Any, ...]] | None = None
        self._users: set[int] = set()

    def acquire(self, user: object) -> tuple[dict[str, Any], tuple[Any, ...]]:
        """(functions by name, the weight arguments), loading them if no session holds them."""
        if self._loaded is None:
            import tvm
            import tvm_ffi

            functions = _vm_functions(self._artifact, self._device)
            arrays = read_weights(self._artifact.path, self._artifact.manifest)
            weights: tuple[Any, ...]
            if self._on_cpu:  # one argument per array, zero-copy (64-byte aligned)
                weights = tuple(tvm.runtime.from_dlpack(a) for a in arrays)
            else:
                weights = (tvm_ffi.Array([tvm.runtime.tensor(a, device=self._device) for a in arrays]),)
            self._loaded = functions, weights
        self._users.add(id(user))
        return self._loaded

    def release(self, user: object) -> None:
        self._users.discard(id(user))
        if not self._users:
            self._loaded = None


class StackedStates:
    """The states of several sessions as one host array per state with a leading slot axis: slot
    i's session runs on block i, a batched decode step (`decode_batch`) on the whole stack.
    Allocated when the first slot needs it, freed when every slot released it."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.arrays: list[np.ndarray] | None = None
        self.refused: str | None = None  # why the states could not be stacked
        self._users: set[int] = set()
        self._tensors: Any = None

    def tensors(self) -> Any:
        """The stacked arrays as the kernels' states tuple (wrapped once per allocation, no copy)."""
        import tvm
        import tvm_ffi

        assert self.arrays is not None, "no slot holds the stacked states"
        if self._tensors is None:
            self._tensors = tvm_ffi.Array([tvm.runtime.from_dlpack(a) for a in self.arrays])
        return self._tensors

    def acquire(self, slot: int, specs: list[tuple[tuple[int, ...], np.dtype[Any]]]) -> list[np.ndarray] | None:
        """Slot `slot`'s blocks, or None when a block would not start 64-byte aligned (the kernels
        take host arrays without a copy only when aligned)."""
        for shape, dtype in specs:
            if int(np.prod(shape)) * dtype.itemsize % 64:
                self.refused = f"a state of {list(shape)} {dtype} is not a whole number of 64-byte lines"
                return None
        if self.arrays is None:
            self.arrays = [aligned_zeros((self.n_slots, *shape), dtype) for shape, dtype in specs]
        self._users.add(slot)
        return [a[slot] for a in self.arrays]

    def release(self, slot: int) -> None:
        self._users.discard(slot)
        if not self._users:
            self.arrays, self._tensors = None, None


class ContextOverflowError(GgufcError, ValueError):
    """More tokens than the compiled context holds; nothing was run."""


class Session:
    """A loaded artifact plus its context (the tokens fed so far live in the states).

    The context can be cut back (`truncate`) and continued: per-position caches by moving the
    end, recurrent states from checkpoints every `checkpoint_interval` tokens (runtime/context.py).
    """

    def __init__(self, artifact: str | os.PathLike[str], *, device: str = "cpu", threads: int | None = None,
                 checkpoint_interval: int | None = None, weights: SharedWeights | None = None,
                 stack: tuple[StackedStates, int] | None = None) -> None:
        """`weights`: kernels and weights shared with other sessions of the same artifact (by default
        the session loads its own); `stack` (CPU): (stacked states, this session's slot) to run on
        its block of them (runtime/slot_group.py)."""
        self._checkpoint_interval = checkpoint_interval
        self._weights = weights
        self._stack = stack
        target_key = DEVICE_TARGET_KEYS.get(device)
        if target_key is None:
            raise ArtifactError(f"unknown device '{device}' (known: {', '.join(DEVICE_TARGET_KEYS)})")
        # Verification (hashes, versions, target) happens here, before kernels.so is opened.
        self._artifact: Artifact | None = open_artifact(artifact, target_key=target_key)
        try:
            if device == "cpu":
                configure_cpu_threads(threads)
            self._load(self._artifact, device)
        except BaseException:
            self.close()
            raise

    def _load(self, artifact: Artifact, device: str) -> None:
        import tvm

        manifest = artifact.manifest
        self.manifest: dict[str, Any] = manifest
        self.n_ctx = int(manifest["n_ctx"])
        self.n_vocab = int(manifest["n_vocab"])
        self.n_embd = _hidden_width(manifest)
        self.max_chunk = int(manifest["max_chunk"])
        self._ubatch: int | None = manifest.get("ubatch")  # split-dependent recurrent numerics (context.py)
        self._device = tvm.device(device)
        self._on_cpu = device == "cpu"
        self._plan: Any = None
        self._released: ReleasedDevice | None = None
        self._kinds = state_kinds(manifest)
        self._state_specs = [array_layout(s) for s in manifest["states"]]
        self._recurrent = [i for i, k in enumerate(self._kinds) if k == RECURRENT]
        self._per_position = [i for i, k in enumerate(self._kinds) if k == PER_POSITION]
        self._windows = {i: WindowCells.from_state(s, self.max_chunk, str(artifact.path))
                         for i, s in enumerate(manifest["states"]) if self._kinds[i] == WINDOW_KIND}
        self._window_from = dict.fromkeys(self._windows, 0)  # the first position each window cache holds
        interval = self._checkpoint_interval or default_interval(self.n_ctx)
        self._context = ContextHistory(self.n_ctx, interval)
        if device in PLAN_DEVICES:  # vulkan / metal: dispatch plan on wgpu or Metal (plan_runtime.py)
            self._load_plan(artifact, device)
            return
        if device == "cuda":  # the artifact's prebuilt fatbin for TVM's CUDA loader (cuda_runtime.py)
            try:
                provide_cuda_binary(artifact.path, manifest)
            except (ValueError, OSError) as exc:
                raise ArtifactError(f"{artifact.path}: {one_line(exc)}") from None
        self._load_kernels_and_weights(artifact)
        self._allocate_states()
        self._token_buffer = aligned_empty(self.max_chunk, np.int32)
        self._shape_tuple = tvm.runtime.ShapeTuple
        self._n_past = 0
        self._decode_inputs = _decode_inputs(manifest, len(self._state_tensors), artifact.path)

    def _load_kernels_and_weights(self, artifact: Artifact) -> None:
        if self._weights is None:
            self._weights = SharedWeights(artifact, self._device, self._on_cpu)
        functions, self._params = self._weights.acquire(self)
        self._functions = dict(functions)

    def _allocate_states(self) -> None:
        import tvm_ffi

        blocks = self._stack[0].acquire(self._stack[1], self._state_specs) if self._stack and self._on_cpu else None
        self._state_arrays = blocks or [aligned_zeros(shape, dtype) for shape, dtype in self._state_specs]
        self._state_tensors = [self._to_device(a) for a in self._state_arrays]
        self._states: Any = tvm_ffi.Array(self._state_tensors)

    def _load_plan(self, artifact: Artifact, device: str) -> None:
        weights = read_weights(artifact.path, self.manifest)
        try:
            self._plan = PlanRunner(artifact.path, self.manifest, weights, device)
        except (PlanError, OSError) as exc:
            raise ArtifactError(f"{artifact.path}: {one_line(exc)}") from None
        except BackendUnavailableError as exc:
            raise ArtifactError(f"cannot run a {device} artifact here: {one_line(exc)}") from None
        self._functions = dict.fromkeys(self._plan.functions)
        self._token_buffer = aligned_empty(self.max_chunk, np.int32)
        self._n_past = 0

    def _to_device(self, array: np.ndarray) -> Any:
        import tvm

        if self._on_cpu:
            return tvm.runtime.from_dlpack(array)  # zero-copy: the array is 64-byte aligned
        return tvm.runtime.tensor(array, device=self._device)

    # ----------------------------------------------------------------- context

    @property
    def n_past(self) -> int:
        """Tokens already in the context."""
        return self._n_past

    @property
    def n_free(self) -> int:
        return self.n_ctx - self._n_past

    @property
    def tokenizer_path(self) -> Path | None:
        tok = self.manifest.get("tokenizer") or {}
        if not tok.get("file") or self._artifact is None:
            return None
        return self._artifact.file(str(tok["file"]))

    @property
    def tokens(self) -> np.ndarray:
        """The tokens in the context, in order (a copy)."""
        return self._context.tokens[: self._n_past].copy()

    @property
    def checkpoint_interval(self) -> int:
        return self._context.interval

    @property
    def stats(self) -> ContextStats:
        """Counts of truncations by how they were served, replayed tokens, checkpoints taken."""
        return self._context.stats

    @property
    def checkpoint_bytes(self) -> int:
        """Host memory held by copies of recurrent state (checkpoints and rollback copies)."""
        return self._context.checkpoint_bytes()

    def reset(self) -> None:
        """Empty the context: zero every state (recurrent states start from zero)."""
        self._context.clear()
        self._window_from = dict.fromkeys(self._windows, 0)
        if self._released is not None and self._released.states is not None:
            self._released.states = {}  # evicted: the restore brings back zeros
        if self._plan is not None:
            self._plan.reset()
            self._n_past = 0
            return
        if self._on_cpu:
            for array in self._state_arrays:
                array[...] = 0
        else:
            for array, tensor in zip(self._state_arrays, self._state_tensors, strict=True):
                array[...] = 0
                tensor.copyfrom(array)
        self._n_past = 0

    def truncate(self, n: int) -> None:
        """Keep the first `n` tokens of the context; the next forward continues at position n with
        the logits a fresh session fed the same tokens would give.

        Per-position caches are cut (cells [n, n_past) cleared); recurrent states come from the
        copy kept at n by a forward with `keep_rollback`, or from the nearest checkpoint <= n and
        a replay of at most `checkpoint_interval - 1` tokens. Window caches move their cells when
        they still hold the window before that point; otherwise the context replays from its
        start (runtime/context.py).
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n <= self._n_past:
            raise ValueError(f"truncate needs a token count in [0, {self._n_past}], got {n!r}")
        n = int(n)
        if n == self._n_past:
            return
        self._ensure_device()
        ctx, stats = self._context, self._context.stats
        stats.truncations += 1
        start, copy, from_rollback = ctx.nearest(n) if self._recurrent else (n, None, False)
        window_replay = not self._windows_hold(start)
        if window_replay:
            start, copy, from_rollback = 0, None, False
        for i in self._per_position:
            self._clear_cells(i, start, self._n_past)
        for i, cells in self._windows.items():
            self._relay_window(i, cells.shift(self._n_past), start)
        for j, i in enumerate(self._recurrent):
            if copy is None:
                self._clear_cells(i, 0, None)
            else:
                self._write_state(i, copy[j])
        ctx.forget_after(n)
        if window_replay:
            stats.window_replays += 1
        elif start == n and not from_rollback:
            stats.cuts += 1
        elif from_rollback:
            stats.rollback_copies += 1
        else:
            stats.checkpoint_restores += 1
        replay = ctx.tokens[start:n].copy()
        self._n_past = start
        if replay.size:
            stats.replayed_tokens += int(replay.size)
            self._feed(replay, all_logits=False, keep_rollback=0)

    def state(self, name: str) -> np.ndarray:
        """The named state (a manifest state name) as a host array, a copy."""
        names = [str(st.get("name")) for st in self.manifest["states"]]
        if name not in names:
            raise ValueError(f"no state named {name!r:.60} (states: {', '.join(names)[:200]})")
        self._ensure_device()
        return self._read_state(names.index(name))

    def reuse_prefix(self, tokens: np.ndarray | list[int]) -> int:
        """Cut the context back to its longest common prefix with `tokens`, leaving at least one of
        them to feed (the next logits need a token); returns how many tokens were kept."""
        want = np.asarray(tokens)
        keep = min(common_prefix(self.tokens, want), max(want.size - 1, 0))
        self.truncate(keep)
        return keep

    # ----------------------------------------------------------------- state access

    def _read_state(self, i: int) -> np.ndarray:
        """State i as a host array (a copy)."""
        shape, dtype = self._state_specs[i]
        if self._plan is not None:
            return self._plan.read_state(i).view(dtype).reshape(shape).copy()
        if self._on_cpu:
            return self._state_arrays[i].copy()
        return np.asarray(self._state_tensors[i].numpy()).reshape(shape)

    def _write_state(self, i: int, value: np.ndarray) -> None:
        if self._plan is not None:
            self._plan.write_state(i, value)
            return
        self._state_arrays[i][...] = value
        if not self._on_cpu:
            self._state_tensors[i].copyfrom(self._state_arrays[i])

    def _clear_cells(self, i: int, start: int, stop: int | None) -> None:
        """Zero cells [start, stop) of state i (all of it for stop None)."""
        if self._on_cpu and self._plan is None:
            self._state_arrays[i][start:stop] = 0
            return
        value = self._read_state(i)
        value[start:stop] = 0
        self._write_state(i, value)

    def _copy_recurrent(self) -> list[np.ndarray]:
        return [self._read_state(i) for i in self._recurrent]

    def _windows_hold(self, n: int) -> bool:
        """Whether every window cache holds the positions a call at n reads before n."""
        return n == 0 or all(max(0, n - cells.size + 1) >= self._window_from[i] for i, cells in self._windows.items())

    def _slide_windows(self, before: int) -> None:
        """After a call from position `before`: each window cache into the next call's layout (the
        window layers of a model share one window: one test per step)."""
        moved = {cells for cells in set(self._windows.values()) if cells.shift(before) != cells.shift(self._n_past)}
        for i, cells in self._windows.items():
            if cells in moved:
                self._relay_window(i, cells.shift(before), self._n_past)

    def _relay_window(self, i: int, old_shift: int, n: int) -> None:
        """Window cache i, laid out from position `old_shift`, holding the positions [from, n) it
        holds of them at cells position - shift(n) and zeros elsewhere (n at most the context)."""
        new_shift = self._windows[i].shift(n)
        keep = min(max(self._window_from[i], new_shift), n)
        if self._plan is not None:  # on the device, no host round trip
            shape, dtype = self._state_specs[i]
            row_bytes = int(np.prod(shape[1:])) * dtype.itemsize
            self._plan.move_cells(i, row_bytes, keep - old_shift, keep - new_shift, n - keep,
                                  (keep - new_shift, n - new_shift))
            self._window_from[i] = keep
            return
        live = self._on_cpu and self._plan is None
        cells = self._state_arrays[i] if live else self._read_state(i)
        if keep < n:  # numpy copies overlapping ranges as memmove does
            cells[keep - new_shift : n - new_shift] = cells[keep - old_shift : n - old_shift]
        cells[: keep - new_shift] = 0
        cells[n - new_shift :] = 0
        if not live:
            self._write_state(i, cells)
        self._window_from[i] = keep

    def _ensure_device(self) -> None:
        """A session whose device memory was released gets it back before it runs or reads."""
        if self._released is not None:
            self.restore_device()

    # ----------------------------------------------------------------- state files

    def _manifest_sha256(self) -> str:
        if self._artifact is None:
            raise ValueError("the session is closed")
        return sha256_file(self._artifact.file(MANIFEST_NAME))

    def save_state(self, path: str | os.PathLike[str]) -> None:
        """Write the whole context (tokens, caches in use, recurrent states, checkpoints) to `path`."""
        self._ensure_device()
        ctx = self._context
        states = self._live_states()
        write_state_file(path, SavedState(self._manifest_sha256(), self.tokens, states, dict(ctx.checkpoints),
                                          dict(ctx.rollback), dict(self._window_from)))

    def load_state(self, path: str | os.PathLike[str]) -> None:
        """Replace the context with the one saved in `path` (by a session of this same artifact)."""
        saved = read_state_file(path, self._manifest_sha256(), len(self._recurrent))
        n = int(saved.tokens.size)
        where = os.fspath(path)
        if n > self.n_ctx or (n and (int(saved.tokens.min()) < 0 or int(saved.tokens.max()) >= self.n_vocab)):
            raise StateFileError(f"{where}: its tokens do not fit this artifact")
        self._check_saved_shapes(saved, where)
        window_from = self._saved_window_from(saved.window_from, n, where)
        self._ensure_device()
        self.reset()
        for i, value in saved.states.items():
            self._write_live_state(i, value)
        ctx = self._context
        ctx.tokens[:n] = saved.tokens
        ctx.checkpoints.update({p: c for p, c in saved.checkpoints.items() if p <= n})
        ctx.rollback.update({p: c for p, c in saved.rollback.items() if p <= n})
        self._window_from = window_from
        self._n_past = n

    def _saved_window_from(self, saved: dict[int, int], n: int, where: str) -> dict[int, int]:
        """The first position each window cache of a loaded context holds: as saved, which must lie
        between the layout's first cell and the window of position n (files without it: the window)."""
        out = {}
        for i, cells in self._windows.items():
            last = max(0, n - cells.size + 1)
            out[i] = saved.get(i, last)
            if not cells.shift(n) <= out[i] <= last:
                raise StateFileError(f"{where}: window state {i} holds positions from {out[i]}, "
                                     f"outside [{cells.shift(n)}, {last}] for {n} tokens")
        return out

    def copy_context(self, source: Session) -> None:
        """Replace the context with `source`'s (a session of this same artifact), as `load_state`
        of its saved state would, without the file: several answers to one prompt read it once."""
        if source._manifest_sha256() != self._manifest_sha256():
            raise ValueError("copy_context needs a session of the same artifact")
        source._ensure_device()
        states = source._live_states()
        n = source.n_past
        self._ensure_device()
        self.reset()
        for i, value in states.items():
            self._write_live_state(i, value)
        ctx, theirs = self._context, source._context
        ctx.tokens[:n] = theirs.tokens[:n]
        ctx.checkpoints.update(copy.deepcopy(dict(theirs.checkpoints)))
        ctx.rollback.update(copy.deepcopy(dict(theirs.rollback)))
        self._window_from = dict(source._window_from)
        self._n_past = n

    def _check_saved_shapes(self, saved: SavedState, where: str) -> None:
        n = int(saved.tokens.size)
        wanted = set(self._per_position) | set(self._recurrent) | set(self._windows)
        if set(saved.states) != wanted:
            raise StateFileError(f"{where}: holds states {sorted(saved.states)}, this artifact has {sorted(wanted)}")
        for i, value in saved.states.items():
            shape, dtype = self._state_specs[i]
            want = (n, *shape[1:]) if i in self._per_position else shape
            if value.shape != tuple(want) or value.dtype != dtype:
                raise StateFileError(f"{where}: state {i} is {value.dtype}{list(value.shape)}, "
                                     f"expected {dtype}{list(want)}")
        for copies in (*saved.checkpoints.values(), *saved.rollback.values()):
            for j, value in zip(self._recurrent, copies, strict=True):
                if value.shape != self._state_specs[j][0] or value.dtype != self._state_specs[j][1]:
                    raise StateFileError(f"{where}: a checkpoint of state {j} has the wrong shape")

    def _live_states(self) -> dict[int, np.ndarray]:
        """Per-position caches' cells in use and whole recurrent states (scratch left out)."""
        out = {i: self._read_state(i)[: self._n_past] for i in self._per_position}
        out.update({i: self._read_state(i) for i in (*self._recurrent, *self._windows)})
        return out

    def _write_live_state(self, i: int, value: np.ndarray) -> None:
        if i in self._per_position:
            full = np.zeros(*self._state_specs[i])
            full[: value.shape[0]] = value
            value = full
        self._write_state(i, value)

    # ----------------------------------------------------------------- device memory

    def release_device(self, evict_state: bool = True) -> None:
        """Give back the device memory of weights, scratch buffers and (evict_state) the states,
        keeping a host copy of the states in use; the next forward (or `restore_device`) brings
        everything back. On the CPU the weights, kernels' scratch and states are freed from the
        process (weights are re-read from the artifact)."""
        if self._released is not None:
            if evict_state and self._released.states is None:
                self.restore_device()
            else:
                return
        states = self._live_states() if evict_state else None
        if self._plan is not None:
            self._plan.release(keep_states=not evict_state)
        else:
            self._functions = dict.fromkeys(self._functions)
            self._params = ()
            if self._weights is not None:
                self._weights.release(self)
            if evict_state:
                self._state_arrays, self._state_tensors, self._states = [], [], None
                if self._stack is not None:
                    self._stack[0].release(self._stack[1])
        self._released = ReleasedDevice(states)
        gc.collect()

    def restore_device(self) -> None:
        """Load weights, kernels and states back after `release_device` (nothing to do otherwise)."""
        released = self._released
        if released is None or self._artifact is None:
            return
        if self._plan is not None:
            self._plan.restore(read_weights(self._artifact.path, self.manifest), keep_states=released.states is None)
        else:
            self._load_kernels_and_weights(self._artifact)
            if released.states is not None:
                self._allocate_states()
        self._released = None
        for i, value in (released.states or {}).items():
            self._write_live_state(i, value)

    @property
    def released(self) -> bool:
        return self._released is not None

    def memory(self) -> dict[str, int]:
        """Memory figures: the process's resident set (`rss_bytes`), host copies kept for a release
        (`shadow_bytes`), checkpoints (`checkpoint_bytes`), and on vulkan/metal the bytes of the
        device buffers held (`device_bytes`, the sizes the GPU API reports for them)."""
        out = {"rss_bytes": resident_bytes(), "checkpoint_bytes": self.checkpoint_bytes,
               "shadow_bytes": sum(a.nbytes for a in ((self._released and self._released.states) or {}).values())}
        if self._plan is not None:
            out["device_bytes"] = self._plan.device_bytes()
        return out

    # ----------------------------------------------------------------- running

    def forward(self, tokens: np.ndarray | list[int], *, all_logits: bool = False,
                keep_rollback: int = 0) -> np.ndarray:
        """Append `tokens` to the context and return float32 logits.

        all_logits=True: [len(tokens), n_vocab], one row per token (teacher forcing).
        all_logits=False: [n_vocab] for the last token.
        Long inputs are split into chunks of at most `max_chunk` (and at checkpoint positions when
        the model has recurrent state; at multiples of the manifest's `ubatch` only where the
        recurrent numerics depend on the split, as llama.cpp's ubatches); the result equals one call.
        keep_rollback=K keeps the recurrent states after each of the last K tokens, so truncating
        back by up to K tokens is a copy (speculative decoding); those tokens then run one per call.
        With it, all-logits rows are computed as one-token calls compute them (the artifact's
        `verify` function, where it has one), so a speculative check sees the logits plain decoding
        would.
        """
        ids = self._checked_tokens(tokens)
        if isinstance(keep_rollback, bool) or not isinstance(keep_rollback, int) or keep_rollback < 0:
            raise ValueError(f"keep_rollback must be a non-negative token count, got {keep_rollback!r}")
        self._ensure_device()
        self._context.rollback.clear()  # copies from an earlier step are not kept
        return self._feed(ids, all_logits=all_logits, keep_rollback=keep_rollback)

    def hidden_states(self, tokens: np.ndarray | list[int]) -> np.ndarray:
        """Append `tokens` to the context and return float32 [len(tokens), n_embd]: each token's
        final hidden state (after the final norm, before the output matrix), as llama.cpp embeds.
        Long inputs run in chunks as `forward` runs them."""
        if EMBED not in self._functions or self.n_embd <= 0:
            raise ArtifactError("this artifact has no hidden-state output (compiled by an older ggufc, or for a GPU "
                                "target, which has none yet); recompile it for the CPU to embed")
        ids = self._checked_tokens(tokens)
        self._ensure_device()
        self._context.rollback.clear()
        return self._feed(ids, all_logits=True, keep_rollback=0, function=EMBED)

    def _feed(self, ids: np.ndarray, *, all_logits: bool, keep_rollback: int,
              function: str | None = None) -> np.ndarray:
        """Run `ids` in chunks ending at checkpoint positions, copying recurrent state there
        (`function`: the entry point of every chunk, which returns all rows)."""
        ctx, start = self._context, self._n_past
        recurrent = bool(self._recurrent)
        end = start + ids.size
        singles_from = end - keep_rollback if recurrent and keep_rollback else end
        ends = split_points(start, ids.size, self.max_chunk, ctx.interval if recurrent else None, singles_from,
                            self._ubatch)
        ctx.tokens[start:end] = ids
        if recurrent and singles_from <= start < end:  # a rollback to before this forward: a copy too
            ctx.rollback[start] = self._copy_recurrent()
        rows, prev = [], start
        for i, stop in enumerate(ends):
            chunk = ids[prev - start : stop - start]
            last = i == len(ends) - 1
            if function is not None:
                fn = function
            elif all_logits:
                fn = VERIFY if keep_rollback and VERIFY in self._functions else "prefill_all"
            elif last and chunk.size == 1 and "decode" in self._functions:
                fn = "decode"
            else:
                fn = "prefill"
            out = self._call(fn, chunk)
            if all_logits or last:
                rows.append(out)
            if recurrent and self._checkpoint_at(stop, end, ids.size) and stop not in ctx.checkpoints:
                ctx.checkpoints[stop] = self._copy_recurrent()
                ctx.stats.checkpoints_taken += 1
            if recurrent and singles_from <= stop < end:
                ctx.rollback[stop] = self._copy_recurrent()
            prev = stop
        if all_logits:
            return rows[0] if len(rows) == 1 else np.concatenate(rows)
        return rows[-1][-1]

    def _checkpoint_at(self, stop: int, end: int, n: int) -> bool:
        """Whether the call ending at `stop` (of a forward of n tokens ending at `end`) leaves a
        checkpoint: at multiples of the interval; for split-dependent models, whose prompts are cut
        only at ubatch multiples, also there and at the end of a forward of several tokens."""
        if stop % self._context.interval == 0:
            return True
        return self._ubatch is not None and (stop % self._ubatch == 0 or (stop == end and n > 1))

    def _before_batch_step(self, token: int) -> int:
        """A batched decode step is about to feed `token` (runtime/slot_group.py): checked as
        `forward` checks it; returns the position it goes to."""
        self._checked_tokens([token])
        self._ensure_device()
        self._context.rollback.clear()
        return self._n_past

    def _after_batch_step(self, token: int) -> None:
        self._context.tokens[self._n_past] = token
        self._n_past += 1

    def _checked_tokens(self, tokens: np.ndarray | list[int]) -> np.ndarray:
        ids = np.asarray(tokens)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"tokens must be a non-empty 1-D sequence, got shape {ids.shape}")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got {ids.dtype}")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.n_vocab:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} outside the vocabulary [0, {self.n_vocab})")
        if self._n_past + ids.size > self.n_ctx:
            raise ContextOverflowError(
                f"context overflow: {self._n_past} tokens in context + {ids.size} new > n_ctx {self.n_ctx}"
            )
        return ids.astype(np.int32, copy=False)

    def _call(self, fn: str, chunk: np.ndarray) -> np.ndarray:
        n = chunk.size
        width = self.n_embd if fn == EMBED else self.n_vocab
        buffer = self._token_buffer[:n]  # prefix of an aligned buffer: still aligned
        buffer[...] = chunk
        if self._plan is not None:  # vulkan / metal: the dispatch plan (window caches moved on the device)
            rows = self._plan.call(fn, buffer, self._n_past)
            self._n_past += n
            if self._windows:
                self._slide_windows(self._n_past - n)
            return rows.reshape(-1, width).astype(np.float32, copy=False)
        if fn == "decode" and self._decode_inputs is not None:  # cuda: token and position in device memory
            token_state, pos_state = self._decode_inputs
            self._state_tensors[token_state].copyfrom(np.asarray(chunk[:1], dtype=np.int32))
            self._state_tensors[pos_state].copyfrom(np.asarray([self._n_past], dtype=np.int32))
        out = self._functions[fn](
            self._to_device(buffer), self._shape_tuple([self._n_past]), self._states, *self._params
        )
        self._n_past += n
        if self._windows:
            self._slide_windows(self._n_past - n)
        logits = np.from_dlpack(out) if self._on_cpu else out.numpy()  # zero-copy on CPU
        return logits.reshape(-1, width).astype(np.float32, copy=False)

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        if self._artifact is not None:
            self._artifact.close()
            self._artifact = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _vm_functions(artifact: Artifact, device: Any) -> dict[str, Any]:
    """Load kernels.so (already hash-checked) and look each manifest function up once."""
    import tvm

    names = artifact.manifest["functions"]
    if "prefill_all" not in names or "prefill" not in names:
        raise ArtifactError(f"{artifact.path}: manifest must list functions 'prefill_all' and 'prefill'")
    try:
        lib = tvm.runtime.load_module(str(artifact.file(KERNELS_NAME)))
        vm = tvm.runtime.vm.VirtualMachine(lib, device)
    except Exception as exc:  # TVM reports loader failures with multi-line messages
        raise ArtifactError(f"{artifact.path}: cannot load {KERNELS_NAME} ({one_line(exc)})") from None
    functions = {}
    for name in (*names, LAYOUT_FUNCTION):
        try:
            functions[name] = vm[name]
        except Exception:
            raise ArtifactError(f"{artifact.path}: {KERNELS_NAME} has no function '{name}'") from None
    # Before any kernel touches a buffer sized from the manifest: the kernels say what they expect.
    check_layout_contract(artifact.manifest, functions.pop(LAYOUT_FUNCTION)(), artifact.path)
    return functions


def _hidden_width(manifest: dict[str, Any]) -> int:
    """The width of the `embed` function's rows (0: the artifact has no such function)."""
    entry = manifest["functions"].get(EMBED) if isinstance(manifest["functions"], dict) else None
    width = entry.get("width") if isinstance(entry, dict) else None
    return width if isinstance(width, int) and not isinstance(width, bool) and width > 0 else 0


def _decode_inputs(manifest: dict[str, Any], n_states: int, where: Path) -> tuple[int, int] | None:
    """cuda artifacts: the states the decode step reads its token and position from."""
    gpu = manifest.get("gpu")
    io = gpu.get("decode_inputs") if isinstance(gpu, dict) else None
    if io is None:
        return None
    try:
        token, pos = int(io["token"]), int(io["pos"])
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(f"{where}: manifest gpu.decode_inputs is malformed") from None
    if not (0 <= token < n_states and 0 <= pos < n_states) or token == pos:
        raise ArtifactError(f"{where}: manifest gpu.decode_inputs {io!r:.60} does not name two states")
    return token, pos
