"""The pipeline's stages, one module each; each stage is `run(inp)` of its own frozen
`Inputs`.

    context.py  Run (config, workdir, grid, tokenizer, model, meshes, engines, data),
                resolved once per run
    wiring.py   each stage's inputs built from the run, and the stage registry
    loops.py    the workdir's files, the checkpointed training-loop skeleton, Progress bars
    lanes.py    the RL lanes side by side, a process each (spawned, watched, SIGTERM forwarded)
    smoke.py    sample from the initial policy and print
    data.py     TFDS array_record splits of every domain of the grid
    sft.py      pi_SFT (QAT from here on)
    rl.py       one lane per domain, efforts annealed from the largest tau: the teachers
                and their manifest (the lane worker is `python -m mopd_jax.lanes`)
    mopd.py     the student distilled from the routed teachers on its own rollouts
    eval.py     pi_SFT, every teacher and the student in every cell of the test split
    report.py   report.json, report.md, plots

`mopd_jax.pipeline` chains them in this order.
"""
