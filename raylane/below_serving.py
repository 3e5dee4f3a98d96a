"""Imported first by the bounded workers' forkserver (`bounded_worker._context` puts it at the head of
the preload): from here on the forkserver runs below the serving processes (SCHED_IDLE), while it
imports the rest of its preload and for every worker it forks after.

The preload (torch and xgrammar for grammars, the embedding model's code) is seconds of CPU per
replica, and the forkservers start as their replicas do, in the background: on the embedded default
they took ~10 CPU-seconds of the two cores in the ten seconds after `raylane serve` said ready, and
a lone first request then waited 0.5-0.75 s for its first token (0.1-0.2 s once they were done)."""

from raylane.bounded_worker import run_below_serving

run_below_serving()
