"""Layer 4, objectives: what a step minimises: next-token cross-entropy (chunked), preference objectives, the MoE load-balancing loss; one protocol (base.py).

Rule: collectives come in as callables or values (a mesh's ranks); never imports parallel/ or loop/.
"""
