"""Layer 5, evals: lm-evaluation-harness on saved models (final/, adapters, hub or bundled models).

Rule: reads saved models in plain transformers/peft; never imports parallel/ or loop/.
"""
