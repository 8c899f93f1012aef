"""The toy's grid as tests build it by hand: the domains and efforts `configs/toy.py` runs,
and its nine cells' names in the order a run's grid gives them (domain-major)."""
DOMAINS = ("gen", "agt", "cod")
EFFORTS = ("low", "high", "max")
NAMES = tuple(f"{d}/{e}" for d in DOMAINS for e in EFFORTS)
