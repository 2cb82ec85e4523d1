"""The machine as a run sees it: `python -m training.core` prints the CPU, what `precision: auto` resolves to, and
whether host memory comes in huge pages (training/core/pages.py), with this process's id."""

import os

from training.core import machine, pages

print(f"cpu: {machine.cpu_description()}")
print("precision auto: {} ({})".format(*machine.auto_precision()))
print(f"memory: {pages.state()}")
print(f"pid: {os.getpid()}")
