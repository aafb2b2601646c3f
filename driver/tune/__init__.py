"""`ggufc tune`: MetaSchedule tuning sessions over a persistent, workload-keyed database.

What is tuned. A model's *decode* kernels (the step that runs once per generated token) are
extracted by lowering its decode function exactly as `build_executable` does, and deduplicated by
their kernel key (op kind, quant format, shapes, attributes: the same tuple `ModuleBuilder` uses
to create each kernel once) plus the target. A workload is tunable when its PrimFunc has only
static tensor arguments: MetaSchedule needs concrete shapes and cannot feed scalar arguments.
That covers the decode matmuls (T = 1), norms and elementwise kernels; it leaves out kernels whose
shape or loop bounds depend on the cache position or on the token count (rope, attention, cache
writes, embeddings, MoE expert matmuls, every prefill kernel), which keep their default schedules.
Quantized matmuls are tuned from their unscheduled compute definition (`quant.gemv_compute`), the
others from the PrimFunc their lowering makes before `schedule_cpu`. The hand-written CPU kernels
(the 8-bit GEMV groups, the vector SwiGLU, causal attention timed at a fixed cache position) are
tuned through their knobs instead (codegen/kernel_knobs.py): a round times the next untried knob
settings against the default kernel, each committed to `knob_records.jsonl` as soon as it is
measured; everything else (budget, priority, the index, `--tuning-min-speedup`) is shared with
MetaSchedule's workloads.

The database (DIR):
    index.json                  one entry per workload: key, target, label, models using it (calls
                                per decode step), default and tuned time (measured by ggufc, same
                                data, interleaved), MetaSchedule's best, trials, status
    workloads/<hash>/           MetaSchedule's JSONDatabase for that workload (records are committed
                                as they are measured, so an interrupted session loses at most the
                                batch in flight) and tune.log
    workloads/<hash>/devices.jsonl  the device that measured each record (rpc.py)
    workloads/<hash>/knob_records.jsonl  a hand-written kernel's measured knob settings (instead of
                                the MetaSchedule database)
The workload hash is sha256 of (repr(kernel key), the target's identifying fields).

Measuring on other devices: with a `rpc.RemoteDevices` (`--rpc-tracker HOST:PORT --rpc-key
KEY`) candidates are built here and measured on the RPC servers a TVM tracker holds under KEY, in
parallel, through MetaSchedule's RPCRunner; see rpc.py.

A session spends trials where they pay off most: every workload first gets one round, the ones
with the largest share of a decode step (default time x calls per step) first; after that each
round goes to the workload with the largest `calls x best time / (1 + trials / round size)`.
`--trials N` is a total for the model, counting records already in the database: a rerun with the
same N tunes nothing new, an interrupted run continues, and workloads another model already tuned
count with their records (every untried workload gets its round before they get another one, and
a further round resumes their search from the database instead of starting over).
`--time-budget` shrinks or skips rounds that would not fit (from the seconds per trial measured so
far) and ends a round still running at the deadline, dropping its unmeasured candidates.

Timing. Default and tuned kernels are timed by ggufc on the same data in interleaved rounds. For a
model bigger than the last-level cache (and on RPC devices) the weight-reading kernels are timed
cold: TVM's `cache_flush_cpu_non_first_arg` flushes every argument but the first (the input
activations) out of the CPU caches before each timed call, as a decode step streams its weights
from memory; MetaSchedule's runner measures those workloads the same way. Each index entry says
its regime (`timing`); a session in the other regime measures the default and the knob settings
again (knob records carry their regime; the other regime's stay in the file, unused).

Compiling with a database (`TunedKernels`, the `ModuleBuilder.tuned` hook) replays a workload's
best record onto its unscheduled PrimFunc, only where ggufc's paired timing found it at least
`min_speedup` times faster than the default kernel, and only for the same compute definition
(structural hash). GPU targets are tuned where a device of that kind exists (SIMT rule set;
default kernels from the GPU lowering); without one, `tune_target` says so.
"""

# Nothing is imported here: MetaSchedule's worker processes import `worker` by its module path,
# and that import must stay cheap (see worker.py).
