"""The pipeline's stages, one module each, every one a function of the run context.

    context.py  Run (config, workdir, grid, tokenizer, model, meshes, engines, data, the
                training-loop skeleton `training`), Progress bars
    smoke.py    sample from the initial policy and print
    data.py     TFDS array_record splits of every domain of the grid
    sft.py      pi_SFT (QAT from here on)
    rl.py       one lane per domain, efforts annealed from the largest tau: the teachers
                and their manifest; also the lane worker (`python -m mopd_jax.stages.rl`)
    mopd.py     the student distilled from the routed teachers on its own rollouts
    eval.py     pi_SFT, every teacher and the student in every cell of the test split
    report.py   report.json, report.md, plots

`mopd_jax.pipeline` chains them in this order.
"""
