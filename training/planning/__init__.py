"""Layer 5, planning: the memory model, the preflight checks and the planner's report.

Rule: plans for the machine it is told about (never probes this one); never imports parallel/ or loop/.
"""
