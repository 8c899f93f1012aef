"""The processes and devices a run executes on: the host allocator (`allocator`, run as
`python -m mopd_jax.runtime.allocator` to name the one a run gets), the multi-host runtime
(`distributed`) and meshes and shardings (`sharding`).
"""
