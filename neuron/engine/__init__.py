"""The engine: requests, continuous-batching scheduler, KV block manager, sampling and output
processing, and the asyncio bridge the server uses."""
