"""The building blocks the topologies wire (middle layer), as plain Python objects.

Env runner (`env_runner`), the policy step for a list of requests (`acting`),
the batching inference server (`inference`), unroll assembly (`unrolls`),
the Learner and its process (`learner`, `learner_process`), the feeds
between acting and learning (`feeds`: batch queue, replay; `replay`: the
buffer), data-parallel gradients (`distributed`, `data_parallel`), GA3C's
dynamic adjuster (`autotune`), thread pools and interval statistics. An
architecture places them in Ray actors (or, under `local`, in one process);
they never know the wiring. The spec sections they consume live in `config`.
Imports go only down, to algorithms/, models/, envs/ and sparse/.
"""
