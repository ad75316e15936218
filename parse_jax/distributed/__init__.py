"""Scale-out: the (data, model) mesh (mesh), sharded models and caches (sharded), verification under `shard_map`
(verify), the multi-host entry (multihost) and its CLI flags (args, no jax import). The sharding rules live beside
the params they describe, in `parse_jax.models.sharding`; loading onto a mesh is `parse_jax.checkpoints.load`."""
