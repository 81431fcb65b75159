"""Chapter 5: per-parameter sharding, FSDP2's design (``fully_shard``), built from scratch.

FSDP1 (``minifsdp.fsdp``) flattens a unit's parameters into one flat parameter and shards that;
FSDP2 shards every parameter on its own along dim 0 and keeps the original parameters.  Checked
against torch's ``torch.distributed.fsdp.fully_shard`` on CPU gloo.
"""
