"""Side-by-side benchmark suite: tiermem against plain autograd, checkpointing and the peers.

One run measures a matrix of configurations (``benchmarks/models_bench.py``
lists them) on a GPT-style decoder (:class:`tiermem.models.TinyGPT`, AdamW,
synthetic tokens), plus the ceilings of the links they use, and writes one JSON,
a Markdown table and PNG plots.

How it measures (each part runs in its own fresh process; this process only
orchestrates and never initialises CUDA):

1. *probe*: the machine (GPU, driver, torch, CPU, RAM, the NVMe dir's disk),
   which configurations can run here and why not, and the **ceilings**: host
   memcpy; on CUDA pinned device-to-host and host-to-device alone and both at
   once (CUDA events, large pinned buffers); the NVMe dir's write/read bandwidth
   through tiermem's I/O engine (O_DIRECT where the filesystem takes it).
2. *interleaved* (``--interleave``, default where it fits): all configurations
   in one process, each with its own deep copy of the same model, stepping in
   turn (round-robin, so drifts of the machine hit all alike); the first
   ``--warmup`` rounds are discarded; median/min/max of ``--steps``. A step is
   zero_grad + forward + backward + AdamW, timed on the host between device
   synchronizations; forward/backward/optimizer split by CUDA events on the
   compute stream (no sync inside the step) or host clocks on the CPU. On
   CUDA, where every configuration's model and AdamW states would take more
   than 3/4 of the device, the configurations are timed each alone instead
   (NOTE [Interleaving must fit the device] in ``configs.py``; a note in
   the JSON says so).
3. *isolated*: one fresh process per configuration for peak memory: CUDA
   ``max_memory_allocated`` (with ``--device-budget``: a
   ``set_per_process_memory_fraction`` budget, so a configuration that does
   not fit is reported as OOM), and peak host RSS (``VmHWM`` after writing 5 to
   ``/proc/self/clear_refs`` once model and optimizer exist). Without
   ``--interleave`` (budgeted sizes) the step times come from these processes,
   one configuration after another. Configurations named in ``--timeline``
   also record one step's memory over time (a sampler thread reading
   ``torch.cuda.memory_allocated`` and the process RSS every ~0.5 ms).

Exactness: every configuration trains from the same parameters with the same
batches and dropout seeds; losses at every step and a fingerprint of the final
parameters and AdamW states are compared with the baseline's (on CUDA with
``torch.use_deterministic_algorithms(True)`` (strict: attention's
deterministic backward) and
``CUBLAS_WORKSPACE_CONFIG=:4096:8``, unless ``--no-deterministic``).

Presets: ``cpu-smoke`` (CI, < 1 min on 2 cores), ``cpu`` (the recorded CPU
table, a few minutes), ``gpu-a`` (baseline fits, activations dominate) and
``gpu-b`` (baseline does not fit a 24 GiB budget); any option overrides the
preset. Example::

    python -m benchmarks.suite --preset cpu --out-dir benchmarks/results --name 2026-11-30-cpu-suite

Outputs ``OUT_DIR/NAME.json``, ``NAME.md``, ``NAME-pareto.png`` and
``NAME-timeline.png`` (plots need matplotlib; ``benchmarks/plots.py NAME.json``
redraws them later).

Run it from the repository root as ``python -m benchmarks.suite``, or from
anywhere as ``python PATH/TO/benchmarks/suite`` (the child processes are
started the second way). Either way this checkout's ``tiermem`` is imported,
not an installed one.

Modules: ``cli`` (options, presets resolved, ``main``), ``configs`` (presets,
the per-configuration merge of its runs), ``orchestrate`` (the parent:
child processes, time budget, progress), ``roles`` (what each child process
runs), ``machine`` (machine description and link ceilings), ``sampler`` (the
one-step memory timeline), ``report`` (finalize: exactness, link analysis,
JSON), ``markdown`` (the table), ``util`` (logging, errors, sizes).
"""

