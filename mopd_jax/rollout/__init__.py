"""Sampling the student's and the teachers' rollouts: the jitted sampler (`sampling`), the
per-row token draw and its log-prob (`token_draw`), continuous batching (`continuous`),
partial rollouts carried across steps (`partial`) and prompts, multi-turn episodes and
environment turns (`turns`).
"""
