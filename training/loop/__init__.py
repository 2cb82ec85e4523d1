"""Layer 6, loop: the run's state, set-up in named steps, the step executors, validation and the loop.

Rule: the only place where data, model, objectives and parallel meet; imported only by the CLIs.
"""
