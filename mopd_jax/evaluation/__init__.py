"""Measuring and reporting a run: the held-out agreement and exact KL of a policy with its
teachers (`agreement`), the run report (`report`, `report_plots`) and the summary of several
seeds (`sweep_report`).
"""
