"""Runs inside a vLLM server's workers (`--worker-extension-cls`): the disk path of the `vllm_server` engine's
weight sync.

The trainer writes its weights as safetensors shards into a directory on storage the server sees
(`vllm_server.write_weights`) and calls `POST /collective_rpc {"method": "gspo_reload_weights", "args":
[directory]}`; every worker of the server (each tensor-parallel rank, each data-parallel replica) reads the
shards and reloads them in place with what the in-process engine uses (`vllm_engine._load_on_worker`: vLLM's
layerwise `reload_weights`, then on the CPU platform the repack of the experts' and tied head's kernels).
Only strings cross the RPC, as vLLM's endpoint requires. Imported by vLLM in its worker processes, never by
the trainer.
"""

from __future__ import annotations

from pathlib import Path

WEIGHT_GLOB = "*.safetensors"


def read_weights(directory: str | Path):
    """(name, tensor) pairs of every safetensors shard in `directory`, shard by shard in name order."""
    from safetensors.torch import load_file

    shards = sorted(Path(directory).glob(WEIGHT_GLOB))
    if not shards:
        raise FileNotFoundError(f"no {WEIGHT_GLOB} weights in {directory}")
    for shard in shards:
        yield from load_file(str(shard)).items()


class DiskWeightReload:
    """vLLM worker extension: `gspo_reload_weights(directory)` → what the reload did (a JSON-able dict)."""

    def gspo_reload_weights(self, directory: str) -> dict:
        from gspo_study.rollout.vllm_engine import _load_on_worker

        weights = list(read_weights(directory))
        done = _load_on_worker(self, weights)
        return {**done, "tensors": len(weights), "directory": str(directory)}
