"""One rank: its model shard, KV cache and communicator, and the handling of every protocol
request. Rank 0 runs it in the leader's process; every other rank runs it behind `neuron --worker`."""
