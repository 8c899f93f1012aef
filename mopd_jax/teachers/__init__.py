"""The frozen teachers and how the student reaches them: the bank and its (domain, effort)
router (`bank`), where the teachers live (`placement`), scoring overlapped with sampling
(`async_scoring`), the teacher server (`server`; its command line is `python -m
mopd_jax.serve`), its client (`client`) and the wire format in vLLM's schema (`wire`).
"""
