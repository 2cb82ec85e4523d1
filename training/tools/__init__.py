"""Layer 9, tools: what the command-line entry points (training/*.py) share that needs the whole stack, as the
trainer itself (the image-text support checks run training.train in-process).

Rule: may import every layer below; nothing below imports it.
"""
