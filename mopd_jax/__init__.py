"""mopd_jax: multi-teacher on-policy distillation (Kimi K3 MOPD) in JAX/Flax.

Subpackages by concern, each importing only those before it:

    config      the run config's schema, blocks, field checks and value types
    models      the transformer, its functional API, KV cache, quantisation, log-probs
    runtime     host allocator, multi-host runtime, meshes and shardings
    io          storage (local and object), checkpoints, Hugging Face files, tokenizers,
                metrics, profiling
    tasks       the task registry and the toy and record tasks, data sets, the task grid,
                prompt views, length budgets
    rollout     the sampler, token draw, continuous batching, partial rollouts, turns
    teachers    the teacher bank and router, placement, async scoring, server, client, wire
    training    losses and their registry, optimizer, train step, SFT, RL, MOPD
    evaluation  held-out agreement and KL, the run report, the sweep summary
    stages      the pipeline's stages, the run context and the wiring of their inputs

and at the top, above the stages: `configure` (the RunConfig built from a ConfigDict with
the algorithms' rules), `pipeline` (the stages chained), `lanes` (the RL lane worker,
`python -m mopd_jax.lanes`) and `serve` (the teacher server, `python -m mopd_jax.serve`).
"""
__version__ = "0.1.0"
