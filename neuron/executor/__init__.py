"""The leader's side of the ranks: spawning workers, fanning each request out to every rank
(rank 0 in-process), draining one reply per worker, the step watchdog and rebuilds."""
